"""Gumbel-max sampling shared by LLaDA's sampler and the parallel-decoding rules built on it."""

from __future__ import annotations

import torch
from torch import Tensor


def add_gumbel_noise(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """exp(logits) / (−log u)^T in float64: its argmax is a sample from softmax(logits / T).
    The reference insists on float64 (low-precision Gumbel noise hurts generation quality)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device="cpu").to(logits.device)
    return logits.exp() / (-torch.log(u)) ** temperature
