"""Rotary tables for `rope_scaling` (moved out of model.py, which re-exports the function)."""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor


def scaled_rotary_cos_sin(positions: Int[Tensor, "batch pos"], d_head: int, theta: float, scaling: dict[str, Any]
                          ) -> tuple[Tensor, Tensor]:
    """Rotary tables for `rope_scaling` "linear" (frequencies / factor) and "llama3" (Llama-3.1's
    wavelength-dependent interpolation); both keep the attention scale at 1, as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, device=positions.device, dtype=torch.float32) / d_head))
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
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()
