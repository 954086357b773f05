"""Attention visibility masks. Convention: boolean, True = the query may attend to the key.

Every builder returns `[batch, 1, query, key]` so that it broadcasts over heads, which is the layout
`torch.nn.functional.scaled_dot_product_attention` accepts.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool
from torch import Tensor

from mdm_lens.errors import InputError


def key_padding(attention_mask: Tensor, n_query: int | None = None) -> Bool[Tensor, "batch 1 query key"]:
    """Hide padded *keys* from every query (LLaDA / HF semantics): pad query rows still attend."""
    if attention_mask.ndim != 2:
        raise InputError(f"attention_mask must be [batch, pos] (1 = real token), got shape {tuple(attention_mask.shape)}.")
    keys = attention_mask.bool()[:, None, None, :]
    n_query = attention_mask.shape[1] if n_query is None else n_query
    return keys.expand(-1, 1, n_query, -1)


def pair_mask(attention_mask: Tensor) -> Bool[Tensor, "batch 1 query key"]:
    """Dream's padded-batch mask: valid query AND valid key (pad rows see nothing; never read them)."""
    valid = attention_mask.bool()
    return (valid[:, None, :, None] & valid[:, None, None, :])


def causal(n: int, device: torch.device | str | None = None) -> Bool[Tensor, "1 1 query key"]:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]


def block_causal(n: int, block_length: int, prefix: int = 0,
                 device: torch.device | str | None = None) -> Bool[Tensor, "1 1 query key"]:
    """Block-diffusion sampling mask: a prefix of `prefix` tokens, then blocks of `block_length`.

    Every position sees the whole prefix and every earlier block; inside a block attention is
    bidirectional. The prefix itself is bidirectional (it is the prompt).
    """
    if block_length <= 0:
        raise InputError(f"block_length must be positive, got {block_length}.")
    idx = torch.arange(n, device=device)
    block = torch.where(idx < prefix, torch.zeros_like(idx), (idx - prefix) // block_length + 1)
    return (block[None, :] <= block[:, None])[None, None]


def combine(*masks: Tensor | None) -> Tensor | None:
    """AND of the masks that are given (None = no restriction)."""
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else (out & m)
    return out
