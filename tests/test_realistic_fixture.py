"""The random-weight fixture (issue #32 §2): every random model the tests build looks trained, so a dropped norm
weight, bias or router bias changes the output and an exactness test catches it.

Two halves: the fixture's own properties (norm weights far from 1, biases far from 0, every norm / bias / router
bias of every family layout drawn), and meta-tests that plant the bug the fixture exists for (one norm weight set to
1 in our model) and check that the exactness comparison against the independent reference then fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "families"))
from family_checkpoints import block_additive_mask, write_llada2, write_lladamoe, write_sdar  # noqa: E402
from family_reference import llada2_forward, lladamoe_forward  # noqa: E402
from tiny_checkpoints import hf_reference, write_dream, write_llada  # noqa: E402

from mdm_lens import HookedMDM, MDMConfig  # noqa: E402
from mdm_lens.bridge.tiny import tiny_diffusion_gemma  # noqa: E402
from mdm_lens.errors import ArgumentError  # noqa: E402
from mdm_lens.init import NORM_LOG_STD, bias_draw, norm_weight_draw, realistic_  # noqa: E402

TOL = 1e-4  # the exactness tests' fp32 tolerance on logits (tests/test_exactness.py, test_family_forward.py)


def _layouts(root) -> dict[str, HookedMDM]:
    """One model per family layout, each loaded from its real on-disk format, plus from_config's default."""
    return {
        "llada": HookedMDM.from_pretrained(write_llada(hf_reference("llada"), root / "llada")),
        "llada_qkv_bias": HookedMDM.from_pretrained(write_llada(hf_reference("dream"), root / "llada_b")),
        "dream": HookedMDM.from_pretrained(write_dream(hf_reference("dream"), root / "dream")),
        "llada2": HookedMDM.from_pretrained(write_llada2(root / "llada2")[0]),
        "lladamoe": HookedMDM.from_pretrained(write_lladamoe(root / "lladamoe")[0]),
        "sdar": HookedMDM.from_pretrained(write_sdar(root / "sdar")[0]),
        "sdar_moe": HookedMDM.from_pretrained(write_sdar(root / "sdar_moe", moe=True)[0]),
        "from_config": HookedMDM.from_config(MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50,
                                                                       qkv_bias=True),
                                             seed=3),
    }


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _layouts(tmp_path_factory.mktemp("realistic"))


def _is_norm(name: str) -> bool:
    return name.endswith(".w")


def _is_bias(name: str) -> bool:
    return "bias" in name.rsplit(".", 1)[-1]


# ---- the fixture's own properties ----------------------------------------------------------------------------
def test_draws_have_the_documented_spread():
    g = torch.Generator().manual_seed(0)
    w = norm_weight_draw((20000,), g)
    assert bool((w > 0).all())  # trained RMSNorm weights keep their sign
    assert abs(float(w.log().std()) - NORM_LOG_STD) < 0.01 and abs(float(w.log().mean())) < 0.01
    assert float((w - 1).abs().mean()) > 0.35  # E|exp(0.5 z) - 1| ≈ 0.42
    b = bias_draw((20000,), 0.1, g)
    assert abs(float(b.std()) - 0.1) < 0.003 and abs(float(b.mean())) < 0.003


@pytest.mark.parametrize("name", ["llada", "llada_qkv_bias", "dream", "llada2", "lladamoe", "sdar", "sdar_moe",
                                  "from_config"])
def test_every_norm_and_bias_of_every_layout_is_drawn(layouts, name):
    """No parameter or buffer is still exactly 1 or 0 everywhere; norms are far from 1, biases far from 0."""
    model = layouts[name]
    tensors = {k: t.detach() for k, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert tensors, name
    for key, t in tensors.items():
        if not t.is_floating_point():
            continue
        assert not bool((t == 1).all()) and not bool((t == 0).all()), f"{name}: {key} is constant {t.flatten()[0]}"
    norms = [t for k, t in tensors.items() if _is_norm(k)]
    biases = [t for k, t in tensors.items() if _is_bias(k)]
    assert norms and all(float((w - 1).abs().mean()) > 0.25 for w in norms), name
    assert all(float(b.std()) > 0.05 for b in biases), name
    has_bias = {"llada": False, "sdar": False, "sdar_moe": False}.get(name, True)
    assert bool(biases) == has_bias, f"{name}: biases {[k for k in tensors if _is_bias(k)]}"


@pytest.mark.parametrize("name", ["llada2", "lladamoe"])
def test_router_biases_are_drawn(layouts, name):
    expert = [t for k, t in layouts[name].named_buffers() if k.endswith("expert_bias")]
    expert += [t for k, t in layouts[name].named_parameters() if k.endswith("expert_bias")]
    assert len(expert) == 2  # the two MoE layers of the tiny layout (moe_layer_freq / first_k_dense_replace)
    assert all(float(t.abs().min()) > 0 and float(t.std()) > 0.05 for t in expert)


def test_from_config_defaults_to_realistic_and_normal_keeps_unit_norms():
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20)
    realistic = HookedMDM.from_config(cfg, seed=1)
    plain = HookedMDM.from_config(cfg, seed=1, init="normal")
    assert float((realistic.ln_final.w.detach() - 1).abs().mean()) > 0.25
    assert bool((plain.ln_final.w == 1).all()) and bool((plain.blocks[0].ln1.w == 1).all())
    # the matrices are the same draw: only norms and biases differ
    assert torch.equal(realistic.embed.W_E, plain.embed.W_E)
    with pytest.raises(ArgumentError, match="init"):
        HookedMDM.from_config(cfg, init="trained")


def test_bridge_tiny_diffusion_gemma_norms_and_scales_are_drawn():
    model = tiny_diffusion_gemma(seed=0).requires_grad_(False)
    scales = {k: t for k, t in model.named_parameters()
              if ("norm" in k or k.endswith("scale")) and "vision" not in k}
    scales |= {k: t for k, t in model.named_buffers() if k.endswith("layer_scalar")}
    assert len(scales) > 20
    for key, t in scales.items():  # DiffusionGemma's RMSNorm multiplies by weight itself: the effective value
        assert float((t - 1).abs().mean()) > 0.1 if t.numel() == 1 else float((t - 1).abs().mean()) > 0.25, key


def test_realistic_refuses_a_bad_seed():
    with pytest.raises(ArgumentError, match="seed"):
        realistic_(torch.nn.Linear(2, 2), seed=-1)


# ---- the fixture does its job: a dropped norm weight fails the exactness comparison ---------------------------
def _drop(model: HookedMDM, key: str) -> None:
    """Plant the bug: the norm weight `key` no longer acts (set to 1, as a forward that skipped it would)."""
    with torch.no_grad():
        dict(model.named_parameters())[key].fill_(1.0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("key", ["ln_final.w", "blocks.0.ln1.w", "blocks.1.ln2.w"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_dropped_norm_weight_fails_exactness_against_transformers(tmp_path, family, key):
    ref = hf_reference(family, n_kv_heads=2)
    writer = write_llada if family == "llada" else write_dream
    model = HookedMDM.from_pretrained(writer(ref, tmp_path / family))
    tokens = _tokens()
    with torch.no_grad():
        expected = ref(tokens, is_causal=False).logits
        if family == "dream":  # the sampler's alignment: hidden i-1 predicts token i (as in test_exactness.py)
            expected = torch.cat([expected[:, :1], expected[:, :-1]], dim=1)
        intact = (model(tokens, return_type="aligned") - expected).abs().max().item()
        _drop(model, key)
        dropped = (model(tokens, return_type="aligned") - expected).abs().max().item()
    assert intact <= TOL  # the comparison itself holds on intact weights
    assert dropped > 100 * TOL, f"{family}: dropping {key} moves the logits by only {dropped:.2e}"


@pytest.mark.parametrize("key", ["ln_final.w", "blocks.1.ln2.w", "blocks.2.attn.k_norm.w"])
def test_dropped_norm_weight_fails_exactness_for_moe(tmp_path, key):
    """LLaDA2 (MoE, q/k norms, grouped routing with expert_bias) against the plain-torch transcription; blocks.1
    and blocks.2 are MoE layers, so ln2 there feeds the router."""
    folder, config, sd = write_llada2(tmp_path / "llada2")
    model = HookedMDM.from_pretrained(folder)
    tokens = _tokens()
    mask = block_additive_mask(11, 4)
    with torch.no_grad():
        expected = llada2_forward(sd, config, tokens, mask)
        intact = (model(tokens, block_length=4) - expected).abs().max().item()
        _drop(model, key)
        dropped = (model(tokens, block_length=4) - expected).abs().max().item()
    assert intact <= TOL
    assert dropped > 100 * TOL, f"llada2: dropping {key} moves the logits by only {dropped:.2e}"


def test_dropped_router_bias_fails_exactness_for_moe(tmp_path):
    """LLaDA-MoE's expert_bias only picks experts: zeroing it must change which experts run."""
    folder, config, sd = write_lladamoe(tmp_path / "lladamoe")
    model = HookedMDM.from_pretrained(folder)
    tokens = _tokens()
    with torch.no_grad():
        expected = lladamoe_forward(sd, config, tokens)
        intact = (model(tokens) - expected).abs().max().item()
        for key, t in list(model.named_buffers()) + list(model.named_parameters()):
            if key.endswith("expert_bias"):
                t.zero_()
        dropped = (model(tokens) - expected).abs().max().item()
    assert intact <= TOL
    assert dropped > 100 * TOL, f"lladamoe: dropping expert_bias moves the logits by only {dropped:.2e}"
