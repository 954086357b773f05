"""How many tokens each step commits, exactly as the reference samplers compute it."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from torch import Tensor


def llada_transfer_counts(block_masked: Bool[Tensor, "batch block"], steps: int) -> Int[Tensor, "batch steps"]:
    """LLaDA `get_num_transfer_tokens`: n // steps per step, the first n % steps steps get one more."""
    n = block_masked.sum(dim=1, keepdim=True)
    base = n // steps
    remainder = n % steps
    counts = base.expand(-1, steps).clone()
    counts += (torch.arange(steps, device=n.device)[None, :] < remainder).long()
    return counts


def dream_timesteps(steps: int, eps: float, device: torch.device | str | None = None) -> Tensor:
    """Dream's `linspace(1, eps, steps + 1)` in float32 (the float32 matters: it sets the int() truncations)."""
    return torch.linspace(1, eps, steps + 1, device=device)


def dream_transfer_count(n_masked_mean: float, t: float, s: float, last: bool) -> int:
    """Dream's k for the confidence algorithms: int(n · (1 − s/t)), all the rest at the last step.

    `n_masked_mean` is the *batch-mean* mask count, as in the reference (a documented quirk)."""
    return int(n_masked_mean) if last else int(n_masked_mean * (1 - s / t))


def dream_schedule(n_masked: int, steps: int, eps: float = 1e-3) -> list[int]:
    """The counts Dream commits per step for one row with `n_masked` masks and no early commits."""
    ts = dream_timesteps(steps, eps)
    left, out = n_masked, []
    for i in range(steps):
        k = dream_transfer_count(torch.tensor(float(left)), ts[i], ts[i + 1], i == steps - 1)
        k = min(int(k), left)
        out.append(k)
        left -= k
    return out
