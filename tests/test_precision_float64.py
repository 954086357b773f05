"""A float64 model computes in float64 (`mdm_lens.precision`): RMSNorm, the per-head q/k norm and the attention
pattern's softmax upcast to fp32 only from narrower dtypes; fp32 models are unchanged (the references' fp32).

Before, `x.float()` downcast float64 activations to fp32 in every norm, so a float64 run carried fp32 rounding
(1e-5 on the tiny Nemotron against its reference, tests/families/test_nemotron_float64.py)."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.precision import at_least_fp32, compute_dtype

TOKENS = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(0))


def _random(dtype: torch.dtype, **extra) -> HookedMDM:
    cfg = MDMConfig(d_model=48, n_layers=2, n_heads=4, d_mlp=96, d_vocab=64, n_ctx=32, norm_eps=1e-3,
                    rope_theta=500.0, dtype=dtype, family="mdm_lens", model_name="precision", extra=extra)
    return HookedMDM.from_config(cfg, seed=1, init_std=0.3, init="realistic")


def _norm_and_softmax_residuals(model: HookedMDM) -> tuple[float, float]:
    """max |ours - float64 formula| of ln1's normalized output and of the pattern, from the model's own inputs."""
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    x = cache["blocks.1.hook_resid_pre"].double()
    want = x / (x.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps).sqrt()
    norm = float((cache["blocks.1.ln1.hook_normalized"].double() - want).abs().max())
    scores = cache["blocks.1.attn.hook_attn_scores"].double()
    pattern = float((cache["blocks.1.attn.hook_pattern"].double() - torch.softmax(scores, -1)).abs().max())
    return norm, pattern


def test_float64_norms_and_patterns_are_float64():
    norm, pattern = _norm_and_softmax_residuals(_random(torch.float64))
    assert norm <= 1e-14 and pattern <= 1e-15, (norm, pattern)


def test_fp32_norms_and_patterns_keep_fp32_rounding():
    """The default is untouched: fp32 results, at fp32 distance from the float64 formula (not closer, not NaN)."""
    norm, pattern = _norm_and_softmax_residuals(_random(torch.float32))
    assert 1e-9 < norm < 1e-5 and 0 <= pattern < 1e-6, (norm, pattern)


def test_the_shipped_twin_in_float64_has_float64_norms_and_patterns():
    twin = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", dtype=torch.float64)
    norm, pattern = _norm_and_softmax_residuals(twin)
    assert norm <= 1e-13 and pattern <= 1e-15, (norm, pattern)


def test_float64_head_norm_is_float64():
    """The per-head q/k RMSNorm (families with `qk_norm`) follows the same rule."""
    from mdm_lens.qk_attention import HeadRMSNorm

    norm = HeadRMSNorm(8, 1e-6, torch.float64)
    with torch.no_grad():
        norm.w.copy_(torch.linspace(0.5, 1.7, 8, dtype=torch.float64))
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 5
    with torch.no_grad():
        want = norm.w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        got = norm(x)
    assert got.dtype == torch.float64 and float((got - want).abs().max()) <= 1e-14


@pytest.mark.parametrize("dtype, want", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                         (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_compute_dtype(dtype, want):
    assert compute_dtype(dtype) == want and at_least_fp32(torch.ones(2, dtype=dtype)).dtype == want


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-3)])
def test_rotated_keys_follow_the_float64_formula_in_float64(dtype, tol):
    """hook_rot_k = k·cos(pθ) + rotate_half(k)·sin(pθ) with θ_i = base^(-2i/d) computed in float64: exact to
    float64 rounding for a float64 model; an fp32 model keeps the references' fp32 tables (error ~ p · 1e-7)."""
    model = _random(dtype)
    model.cfg.rope_theta = 1e6  # slow frequencies: the fp32 phase error is visible at p ~ 30
    tokens = torch.randint(0, 60, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.attn.hook_"))
    k, rot = cache["blocks.0.attn.hook_k"].double(), cache["blocks.0.attn.hook_rot_k"].double()
    d = k.shape[-1]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(32, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    want = k * cos + torch.cat([-k[..., d // 2:], k[..., : d // 2]], -1) * sin
    err = float((rot - want).abs().max() / want.abs().max())
    assert err <= tol, err
    if dtype == torch.float32:
        assert err > 1e-9  # fp32 rounding is there, so the float64 bound above is not vacuous
