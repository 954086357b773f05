"""Approximate KV caching as Fast-dLLM does it on LLaDA: one full forward fills every layer's keys and values, then
forwards over a window of query rows attend to [cached keys; this forward's keys].

* `prefix`: the cache keeps the positions before the current block (`trim(start)`); a window forward computes
  fresh keys/values for every position from the block start on.
* `dual`: the cache keeps every position; a window forward over the block writes its fresh keys/values into the
  cache in place (the reference's `replace_position` overwrite) and attends to the whole cached sequence.

Keys are cached after the rotary embedding at their own positions (the reference caches them before it and
rotates all keys again at each forward: the same numbers). Hooks on a cached forward see the rows it really
computes (`hook_rot_k` / `hook_v`: the window's new rows; `hook_pattern`: `[batch, head, window, all keys]`).
Block diffusion (SDAR, `mdm_lens.diffusion.sdar`) caches exactly: `append` forwards (the prompt's whole blocks, a
finished block) attend to [cache; own rows] and keep their rows; `block` forwards (a block being denoised) attend
the same way and keep nothing. An empty cache is allowed in both (a prompt shorter than one block).

`age[pos]` is the step whose forward computed the keys/values a forward attends to at `pos` (the window's own rows:
that forward's step; -1: not cached). `LayerKV.attended(rows, "k"|"v")` gives, from a hook on the window's rows
(`hook_rot_k` / `hook_v`), the whole key/value sequence that forward attends to, without touching the cache (what
`KeyValueNorms` and `TopKKeys` read on cached runs).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

MODES = ("prefix", "dual")


class LayerKV:
    """One layer's cache `[batch, pos, kv_head, d_head]`; called by `Attention.forward` with the new rows."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.mode = "fill"
        self.window: tuple[int, int] | None = None

    def attended(self, rows: Tensor, which: str) -> Tensor:
        """The keys (`which="k"`) or values ("v") a forward whose new rows are `rows` attends to in the current mode:
        position order, cached rows where this forward computes none; the cache is left as it is."""
        cached = self.k if which == "k" else self.v
        if self.mode == "fill" or (self.mode in ("block", "append") and cached is None):
            return rows
        if cached is None:
            raise RuntimeError("a cached forward ran before the cache was filled")
        if self.mode in ("block", "append", "prefix"):
            return torch.cat([cached, rows], dim=1)
        start, end = self.window  # type: ignore[misc]
        out = cached.clone()
        out[:, start:end] = rows
        return out

    def __call__(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.mode == "fill":
            self.k, self.v = k, v
            return k, v
        if self.mode in ("block", "append"):  # block diffusion: earlier blocks never attend later ones
            if self.k is not None and self.v is not None:
                k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
            if self.mode == "append":  # a finished block's rows join the cache for good
                self.k, self.v = k, v
            return k, v
        if self.k is None or self.v is None:
            raise RuntimeError("a cached forward ran before the cache was filled")
        if self.mode == "prefix":
            return torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        start, end = self.window  # type: ignore[misc]
        self.k[:, start:end] = k  # in place, as the reference's replace_position
        self.v[:, start:end] = v
        return self.k, self.v


class KVCache:
    """Every layer's `LayerKV` of one model, and the step each cached position was computed at."""

    def __init__(self, model: Any, total: int):
        self.model = model
        self.layers = [LayerKV() for _ in model.blocks]
        self.age = torch.full((total,), -1, dtype=torch.long)  # -1: not cached

    @contextmanager
    def attached(self, mode: str, window: tuple[int, int] | None = None) -> Iterator["KVCache"]:
        """Route every layer's keys/values through the cache for the forwards inside; always detached after."""
        for block, layer in zip(self.model.blocks, self.layers):
            layer.mode, layer.window = mode, window
            block.attn.kv = layer
        try:
            yield self
        finally:
            for block in self.model.blocks:
                block.attn.kv = None

    def filled(self, step: int) -> None:
        self.age[:] = step

    def trim(self, upto: int) -> None:
        """Keep the positions before `upto` (the prefix cache after its block-start forward)."""
        for layer in self.layers:
            layer.k, layer.v = layer.k[:, :upto], layer.v[:, :upto]  # type: ignore[index]
        self.age[upto:] = -1

    def computed(self, start: int, end: int, step: int) -> None:
        """Positions [start, end) get fresh keys/values at `step` (set before that forward runs)."""
        self.age[start:end] = step
