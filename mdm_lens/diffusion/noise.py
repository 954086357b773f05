"""Sampling primitives the samplers share: LLaDA's float64 Gumbel-max, and Dream's `sample_tokens` with its top-p /
top-k filters (also used by the ARM and by Fast-dLLM's Dream loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def add_gumbel_noise(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """exp(logits) / (−log u)^T in float64: its argmax is a sample from softmax(logits / T).
    The reference insists on float64 (low-precision Gumbel noise hurts generation quality)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device="cpu").to(logits.device)
    return logits.exp() / (-torch.log(u)) ** temperature


def top_p_logits(logits: Tensor, top_p: float) -> Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()  # keep the first token past the threshold
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits: Tensor, top_k: int) -> Tensor:
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens_bytes(dtype_bytes: int, temperature: float = 0.0, top_p: float | None = None,
                        top_k: int | None = None, margin_confidence: bool = False, neg_entropy: bool = False) -> int:
    """Peak bytes per logit `sample_tokens` allocates beside its input (profiled, fp32 and bf16): the tempered copy,
    then the largest of: the softmax; with temperature its fp32 copy (none for fp32) and multinomial's fp32
    workspace; top-p's sorted values, int64 order, softmax and cumulative sum with its two boolean masks; top-k's
    masked copy; the margin's sorted probabilities and order; the entropy's shifted probabilities and their log."""
    s = dtype_bytes
    tempered = s if temperature > 0 else 0
    paths = [s]
    if temperature > 0:
        paths.append(s + 4 * int(s != 4) + 4)
    if top_p is not None and top_p < 1:
        paths.append(3 * s + 8 + 2)
    if top_k is not None:
        paths.append(2 * s)
    if margin_confidence:
        paths.append(2 * s + 8)
    if neg_entropy:
        paths.append(3 * s)
    return tempered + max(paths)


def sample_tokens(logits: Tensor, temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                  margin_confidence: bool = False, neg_entropy: bool = False,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Dream's `sample_tokens`: (confidence, token) per row of `logits [n, vocab]`."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs.float().cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
        confidence = torch.gather(probs, -1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top2 = torch.sort(probs, dim=-1, descending=True)[0][:, :2]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0
