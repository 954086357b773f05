"""Nemotron-Labs-Diffusion in float64 agrees with the reference transcription to ~1e-12, and the YaRN / llama-4
tables equal the formula (shared/specs/families-2.md §9.4; transformers' `_compute_yarn_parameters`).

The discrepancy this pins (float64 ours vs reference 1.3e-5 on the tiny layout, 4e-3 at d_model 256 / 256
positions) was not the rotary tables: both sides built the same fp32 tables. It was every `.float()` of a float64
activation (RMSNorm statistics on both sides, which then rounded `x / sqrt(v)` against `x * rsqrt(v)` in fp32; the
reference's fp32 softmax against our float64 SDPA). With every step float64 (`mdm_lens.precision`) the two agree to
5e-14 / 3e-11; the tables are float64 too, so a float64 run does not carry fp32 phase errors (~p · 6e-8 rad)."""

from __future__ import annotations

import math

import pytest
import torch
from nemotron_fixture import CONFIG, MASK_ID, reference_forward, reference_inv_freq, write_nemotron

from mdm_lens import HookedMDM
from mdm_lens.rotary import QScaledCos, scaled_rotary_cos_sin, yarn_inv_freq

# d_model 128, 256 positions: YaRN factor 2.5 (no power of two: 1/(factor·f) and (1/f)/factor round differently
# in fp32), attention factor mscale(2.5, 1.2) / mscale(2.5, 0.7) != 1, and 256 positions over an original length of
# 64, so the llama-4 query scale takes four values (1, 1 + β ln 2, 1 + β ln 3, 1 + β ln 4)
WIDE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            num_hidden_layers=2, max_position_embeddings=512,
            rope_parameters=dict(rope_type="yarn", factor=2.5, original_max_position_embeddings=64, beta_fast=8.0,
                                 beta_slow=1.0, mscale=1.2, mscale_all_dim=0.7, llama_4_scaling_beta=0.2,
                                 rope_theta=5000.0))
SIZES = {"tiny": ({}, 40), "d128_T256": (WIDE, 256)}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("size", list(SIZES))
def test_float64_forward_matches_the_reference_to_1e_10(tmp_path, size):
    overrides, t = SIZES[size]
    folder, config, sd = write_nemotron(tmp_path / "ckpt", **overrides)
    model = HookedMDM.from_pretrained(str(folder), dtype=torch.float64, load_tokenizer=False)
    sd64 = {k: v.double() for k, v in sd.items()}
    tokens = torch.randint(0, MASK_ID, (2, t), generator=torch.Generator().manual_seed(3))
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    with torch.no_grad():
        ref, _ = reference_forward(sd64, config, tokens)
        ref_ar, _ = reference_forward(sd64, config, tokens, causal=True)
        fast = model(tokens)  # SDPA path
        hooked, cache = model.run_with_cache(tokens)  # explicit scores / pattern path
        fast_ar = model(tokens, attn_mask=causal)
    assert ref.dtype == fast.dtype == torch.float64
    for got, want in ((fast, ref), (hooked, ref), (fast_ar, ref_ar)):
        assert _max_diff(got, want) <= 1e-10, _max_diff(got, want)
    assert _max_diff(ref, ref_ar) > 1e-2  # the causal comparison is not the bidirectional one again
    assert cache["blocks.0.ln1.hook_scale"].dtype == torch.float64
    assert cache["blocks.1.attn.hook_pattern"].dtype == torch.float64
    # every position past the original length: the query scale is on (the tables go beyond 16 / 64 positions)
    rope = config["rope_parameters"]
    assert t > 2 * rope["original_max_position_embeddings"] and rope["factor"] != 1.0


def _formula_tables(p: int, d: int, theta: float, factor: float, original: float, fast: float, slow: float,
                    attention: float) -> tuple[list[float], list[float]]:
    """cos, sin of position p for the first d/2 frequencies, in Python floats straight from the spec's formula."""
    def corr(rot: float) -> float:
        return d * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), d - 1)
    cos, sin = [], []
    for i in range(d // 2):
        wave = theta ** (2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: the plain frequency, 1: divided by factor
        inv = ramp / (factor * wave) + (1 - ramp) / wave
        cos.append(math.cos(p * inv) * attention)
        sin.append(math.sin(p * inv) * attention)
    return cos, sin


def test_yarn_and_query_scale_tables_equal_the_formula_at_planted_positions():
    # d 8, theta 100, original 64: correction dims 0.81 -> 0 and 2.02 -> 3, so the ramp is 0, 1/3, 2/3, 1
    scaling = dict(rope_type="yarn", factor=2.5, original_max_position_embeddings=64.0, beta_fast=4.0,
                   beta_slow=1.0, llama_4_scaling_beta=0.3)
    attention = 0.1 * math.log(2.5) + 1  # no mscale keys: get_mscale(factor)
    positions = torch.tensor([[0, 1, 63, 64, 200, 1000]])
    cos, sin = scaled_rotary_cos_sin(positions, 8, 100.0, scaling, torch.float64)
    assert isinstance(cos, QScaledCos) and cos.cos.dtype == torch.float64 and cos.q_scale.dtype == torch.float64
    for j, p in enumerate(positions[0].tolist()):
        want_cos, want_sin = _formula_tables(p, 8, 100.0, 2.5, 64.0, 4.0, 1.0, attention)
        got_cos, got_sin = cos.cos[0, j, 0], sin[0, j, 0]
        # rotate-half layout: the d/2 frequencies twice
        assert torch.allclose(got_cos, torch.tensor(want_cos * 2, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.allclose(got_sin, torch.tensor(want_sin * 2, dtype=torch.float64), rtol=0, atol=1e-12)
    scale = cos.q_scale[0, :, 0, 0].tolist()
    want = [1.0, 1.0, 1.0, 1 + 0.3 * math.log(2), 1 + 0.3 * math.log(4), 1 + 0.3 * math.log(16)]
    assert scale == pytest.approx(want, abs=1e-15)
    # the default fp32 tables are off by fp32 phase error at position 1000, so float64 is a real difference
    cos32, _ = scaled_rotary_cos_sin(positions, 8, 100.0, scaling)
    assert cos32.cos.dtype == torch.float32
    assert 1e-9 < float((cos32.cos.double() - cos.cos).abs().max()) < 1e-3


@pytest.mark.parametrize("factor", [0.25, 2.5, 3.0])
def test_fp32_yarn_frequencies_are_bit_identical_to_the_reference(factor):
    """fp32 (the default) keeps the references' fp32 tables, rounding included: 1/(factor·pos_freqs)."""
    params = {**CONFIG["rope_parameters"], "factor": factor}
    want, att = reference_inv_freq({**CONFIG, "rope_parameters": params})
    scaling = {**params, "original_max_position_embeddings": float(params["original_max_position_embeddings"])}
    got, got_att = yarn_inv_freq(24, params["rope_theta"], scaling, torch.device("cpu"))
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want) and got_att == att


def test_a_model_moved_to_float64_builds_float64_tables(tmp_path):
    folder, _, _ = write_nemotron(tmp_path / "ckpt")
    tokens = torch.randint(0, MASK_ID, (1, 40), generator=torch.Generator().manual_seed(4))
    moved = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    with torch.no_grad():
        moved(tokens)  # fills the fp32 rotary cache first
        moved.to(torch.float64)
        got = moved(tokens)
        want = HookedMDM.from_pretrained(str(folder), dtype=torch.float64, load_tokenizer=False)(tokens)
    assert got.dtype == torch.float64 and _max_diff(got, want) <= 1e-12


def test_float64_plain_rope_matches_the_reference(tmp_path):
    """No rope_parameters: the plain rotary tables (`rotary_cos_sin`) are float64 for a float64 model too."""
    folder, config, sd = write_nemotron(tmp_path / "ckpt", drop=("rope_parameters",))
    model = HookedMDM.from_pretrained(str(folder), dtype=torch.float64, load_tokenizer=False)
    assert "rope_scaling" not in model.cfg.extra
    tokens = torch.randint(0, MASK_ID, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = reference_forward({k: v.double() for k, v in sd.items()}, {**config, "rope_theta": 1e6}, tokens)
        got = model(tokens)
    assert _max_diff(got, want) <= 1e-10, _max_diff(got, want)
