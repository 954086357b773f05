"""Scaled rotary tables: `rope_scaling` "linear", "llama3" and "yarn", and the llama-4 query scale.

* linear / llama3: frequencies divided by `factor` (llama3: only the long wavelengths, the band between
  interpolated); the attention scale stays 1, as in transformers.
* yarn (transformers' `_compute_yarn_parameters`, which Nemotron-Labs-Diffusion's Ministral-3 backbone runs, and
  the vLLM port `nemotron_dllm.py` reproduces): per frequency a blend of the plain ("extrapolated") and the
  `1/factor` ("interpolated") frequency, by a linear ramp between the correction dimensions of `beta_fast` /
  `beta_slow` rotations over `original_max_position_embeddings` (rounded outward unless `truncate` is False);
  cos and sin are multiplied by `attention_factor` (default `mscale(factor, mscale) / mscale(factor,
  mscale_all_dim)`, or `mscale(factor)`; 1 whenever factor <= 1, as in the released Nemotron configs).
* llama-4 query scale (Ministral-3 `get_llama_4_attn_scale`): after the rotation the query at absolute position p
  is multiplied by `1 + beta * log(1 + floor(p / original_max_position_embeddings))` (1 below that length). It
  depends on positions the attention does not see, so the table builder returns the cos table as `QScaledCos`
  (the cos table and the per-position scale); the family attention applies the scale after rotating q
  (`mdm_lens.qk_attention`), so `hook_rot_q` holds the query the scores are computed from.

Precision: the references (transformers' rotary classes, vLLM's `get_rope` cache and its query scale) build every
table in fp32 and cast it to the model dtype, and so do these tables for fp32 / bf16 / fp16 models (bit-faithful).
A float64 model gets float64 tables (`table_dtype`, `mdm_lens.precision`): inverse frequencies, ramp, positions and query scale, so a
float64 run is float64 throughout (the exactness tests compare it with the reference at 1e-10).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens.precision import compute_dtype as table_dtype  # noqa: F401  (the tables' dtype)


class QScaledCos(NamedTuple):
    """The cos table of a llama-4-scaled model and the query scale per position `[batch, pos, 1, 1]`."""

    cos: Tensor
    q_scale: Tensor


def _pos_freqs(d_head: int, theta: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`theta^(2i/d_head)`, the wavelengths / 2π of the plain rotary."""
    return theta ** (torch.arange(0, d_head, 2, device=device, dtype=dtype) / d_head)


def _plain_inv_freq(d_head: int, theta: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    return 1.0 / _pos_freqs(d_head, theta, device, dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's `0.1 * mscale * ln(scale) + 1`, and 1 for scale <= 1 (no interpolation, no temperature)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(d_head: int, theta: float, scaling: dict[str, Any], device: torch.device,
                  dtype: torch.dtype = torch.float32) -> tuple[Tensor, float]:
    """(inverse frequencies `[d_head/2]` in `dtype`, attention factor) of a yarn scaling (module docstring)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return d_head * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_head - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(d_head // 2, dtype=dtype, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the plain frequency
    pos_freqs = _pos_freqs(d_head, theta, device, dtype)
    # 1 / (factor * pos_freqs), not (1 / pos_freqs) / factor: the references' rounding when factor is no power of 2
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep, float(attention)


def llama4_q_scale(positions: Int[Tensor, "batch pos"], beta: float, original: float,
                   dtype: torch.dtype = torch.float32) -> Float[Tensor, "batch pos 1 1"]:
    """`1 + beta * log(1 + floor(p / original))` per position in `dtype`, shaped to broadcast over heads and
    d_head."""
    return (1 + beta * torch.log(1 + torch.floor(positions.to(dtype) / original)))[:, :, None, None]


def scaled_rotary_cos_sin(positions: Int[Tensor, "batch pos"], d_head: int, theta: float, scaling: dict[str, Any],
                          dtype: torch.dtype = torch.float32) -> tuple[Tensor | QScaledCos, Tensor]:
    """Rotary tables `[batch, pos, 1, d_head]` in `dtype` (`table_dtype` of the model's) for a `rope_scaling`
    dict (see the module docstring); the cos table comes as `QScaledCos` when `scaling` carries
    `llama_4_scaling_beta`."""
    attention, device = 1.0, positions.device
    if scaling["rope_type"] == "yarn":
        inv_freq, attention = yarn_inv_freq(d_head, theta, scaling, device, dtype)
    elif scaling["rope_type"] == "default":  # plain rotary, here only for a llama-4 query scale
        inv_freq = _plain_inv_freq(d_head, theta, device, dtype)
    else:
        inv_freq = _plain_inv_freq(d_head, theta, device, dtype)
        factor = scaling["factor"]
        if scaling["rope_type"] == "linear":
            inv_freq = inv_freq / factor
        else:  # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            slowed = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            blended = (1 - smooth) * slowed / factor + smooth * slowed
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            inv_freq = torch.where(medium, blended, slowed)
    freqs = positions.to(dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    beta = scaling.get("llama_4_scaling_beta")
    if beta is not None:
        return QScaledCos(cos, llama4_q_scale(positions, float(beta),
                                              float(scaling["original_max_position_embeddings"]), dtype)), sin
    return cos, sin
