"""Attention-pattern rows a query chunk at a time, for statistics that *reduce* the pattern
(received attention, top-k keys, absorption) without holding a `[batch, head, T, T]` tensor.

Interface (the attention module of `HookedMDM` implements it; the transformers-native bridge can too):

* A **row consumer** (a `RowConsumer`) is attached to one layer for one forward pass by a TL hook on that
  layer's `attn.hook_rot_k` (`row_hook(model, layer, consumer)` builds the `(name, fn)` pair). The hook
  leaves the tensor unchanged; it only calls `attn.add_row_consumer(consumer)`. So TransformerLens'
  `hooks()` / `run_with_hooks` installs and removes consumers like any other hook, also when a run raises,
  and `hook_pattern` is *not* hooked. The attention forgets its consumers at the start and end of every
  forward.
* The attention, when it has consumers:
  - if nothing hooks `hook_attn_scores` / `hook_pattern` (and `force_explicit` is off), it computes the
    pattern `query_chunk` rows at a time (`PatternRows.chunks`), hands every chunk to every consumer and
    builds z from the same chunks (`row_mode="explicit"`, the default) or with SDPA (`row_mode="sdpa"`):
    the largest transient is a few `[batch, head, chunk, key]` buffers;
  - otherwise it runs the full explicit path as before (TL semantics: hooks see, and may edit, the whole
    scores/pattern) and hands the hooked pattern to the consumers as one chunk.
* Calls per forward, per consumer: `start(rows)` with the layer's `PatternRows`; `consume(pattern, start)`
  for consecutive chunks covering queries `0 … n_queries-1` in order, where `pattern[b, h, i, j]` is
  exactly what `hook_pattern` would hold at query `start + i` (model dtype, rows summing to one over the
  visible keys, fully-masked rows zero); then `finish()`.
* `PatternRows.select(index)` gives any rows again later (e.g. the rows a sampler commits, known only
  after the forward): recomputed from the layer's q, k and mask, which it keeps (linear memory), or
  sliced from the held pattern on the full path.

Chunk size: `attn.query_chunk` (an int), or None = `chunk_rows(...)` from `ROW_CHUNK_BYTES` (one fp32
`[batch, head, chunk, key]` buffer; env `MDM_LENS_ROW_CHUNK_MB`, default 32 MiB; the transient peak of a
chunk is about three such buffers).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.precision import compute_dtype

ROW_CHUNK_BYTES = int(float(os.environ.get("MDM_LENS_ROW_CHUNK_MB", "32")) * 2**20)
ROW_MODES = ("explicit", "sdpa")


def chunk_rows(batch: int, heads: int, n_queries: int, n_keys: int, budget_bytes: int | None = None) -> int:
    """Query rows per chunk so that one fp32 `[batch, head, chunk, key]` buffer fits `budget_bytes`."""
    budget = ROW_CHUNK_BYTES if budget_bytes is None else budget_bytes
    per_row = max(1, batch * heads * n_keys * 4)
    return max(1, min(n_queries, budget // per_row))


def masked_scores(q_scaled: Float[Tensor, "batch head query d_head"], k: Float[Tensor, "batch kv_head key d_head"],
                  mask: Bool[Tensor, "batch 1 query key"] | None, causal_queries: Int[Tensor, "query"] | None
                  ) -> Float[Tensor, "batch head query key"]:
    """`q·kᵀ` (q already scaled by 1/√d_head) with hidden pairs at -inf.

    GQA: the r query heads of a group are folded into the query axis, so K is read once per group (head
    j uses kv head j // r, HF's repeat_kv order). `causal_queries` (the query positions) masks keys
    after each query when there is no explicit mask (a causal mask is already inside `mask`)."""
    b, h, n, e = q_scaled.shape
    g, n_keys = k.shape[1], k.shape[-2]
    scores = torch.matmul(q_scaled.reshape(b, g, (h // g) * n, e), k.transpose(-1, -2)).view(b, h, n, n_keys)
    if mask is not None:
        return scores.masked_fill(~mask, float("-inf"))
    if causal_queries is not None:  # the diagonal stays visible, so no row can be emptied
        future = torch.arange(n_keys, device=k.device)[None, :] > causal_queries[:, None]
        return scores.masked_fill(future, float("-inf"))
    return scores


def softmax_rows(scores: Tensor, masked: bool, dtype: torch.dtype) -> Tensor:
    """fp32 softmax over keys (float64 for float64 scores, `mdm_lens.precision`); a fully-masked row (pad rows
    under Dream's pair mask) is NaN and set to 0."""
    pattern = torch.softmax(scores, dim=-1, dtype=compute_dtype(scores.dtype))
    if masked:
        pattern = torch.nan_to_num(pattern, nan=0.0)
    return pattern.to(dtype)


class PatternRows:
    """The pattern of one layer's forward, row by row: recomputed from (q, k, mask) or sliced from a held
    full pattern (`pattern=`, the explicit path)."""

    def __init__(self, q_scaled: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, dtype: torch.dtype,
                 pattern: Tensor | None = None):
        self.q, self.k, self.mask, self.is_causal, self.dtype = q_scaled, k, mask, is_causal, dtype
        self.pattern = pattern
        self.batch, self.n_heads, self.n_queries = q_scaled.shape[:3]
        self.n_keys = k.shape[-2]
        self.device = q_scaled.device

    @property
    def full(self) -> bool:
        return self.pattern is not None

    def _compute(self, q: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
        causal = positions if self.is_causal and self.mask is None else None
        return softmax_rows(masked_scores(q, self.k, mask, causal), self.mask is not None, self.dtype)

    def rows(self, start: int, stop: int) -> Float[Tensor, "batch head chunk key"]:
        """Rows `start:stop` (contiguous queries)."""
        if self.pattern is not None:
            return self.pattern[:, :, start:stop]
        mask = None if self.mask is None else self.mask[..., start:stop, :]
        positions = torch.arange(start, stop, device=self.device)
        return self._compute(self.q[:, :, start:stop], mask, positions)

    def select(self, index: Int[Tensor, "n"]) -> Float[Tensor, "batch head n key"]:
        """Any rows, by query position (a 1-d long tensor)."""
        index = index.to(self.device)
        if self.pattern is not None:
            return self.pattern.index_select(2, index)
        mask = None if self.mask is None else self.mask.index_select(-2, index)
        return self._compute(self.q.index_select(2, index), mask, index)

    def chunks(self, size: int) -> Iterator[tuple[int, Tensor]]:
        """`(start, rows)` for consecutive chunks of `size` queries (the last may be shorter)."""
        if self.pattern is not None:
            yield 0, self.pattern
            return
        for start in range(0, self.n_queries, size):
            yield start, self.rows(start, min(start + size, self.n_queries))


class RowConsumer:
    """Base of per-layer, per-forward pattern-row statistics (see the module docstring)."""

    def start(self, rows: PatternRows) -> None:
        """Once per forward, before any rows. Keep `rows` only if needed later: it holds q and k."""

    def consume(self, pattern: Float[Tensor, "batch head chunk key"], start: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class ColumnSums(RowConsumer):
    """`Σ_i w[b, i] · A[b, h, i, j]` → `result [batch, head, key]`, reduced chunk by chunk.

    `weights(rows)` returns the `[batch, query]` query weights once the layer's sizes are known (a
    callable, because ARM prefixes grow). Each chunk is reduced in `dtype` and the chunks are added in
    float64, so the result does not depend on the chunk size beyond the last bits. `kind="mass"` divides
    by Σ_i w[b, i]; a row whose query set is empty is NaN (undefined), never 0."""

    def __init__(self, weights: Any, kind: str = "mass", dtype: torch.dtype = torch.float32):
        self.weights_fn, self.kind, self.dtype = weights, kind, dtype
        self.result: Tensor | None = None

    def start(self, rows: PatternRows) -> None:
        self.w = self.weights_fn(rows).to(device=rows.device, dtype=self.dtype)
        self.acc = torch.zeros(rows.batch, rows.n_heads, rows.n_keys, dtype=torch.float64, device=rows.device)

    def consume(self, pattern: Tensor, start: int) -> None:
        self.add(pattern, self.w[:, start:start + pattern.shape[2]])

    def add(self, pattern: Float[Tensor, "batch head n key"], weights: Float[Tensor, "batch n"]) -> None:
        """Add rows given with their own weights (e.g. `PatternRows.select` of chosen queries)."""
        self.acc += torch.einsum("bhqk,bq->bhk", pattern.to(self.dtype), weights.to(self.dtype))

    def finish(self) -> None:
        out = self.acc
        if self.kind == "mass":  # the mean over an empty query set is undefined: NaN, not 0
            n = self.w.sum(-1).to(torch.float64)[:, None, None]
            out = torch.where(n > 0, out / n.clamp(min=1e-300), torch.full_like(out, float("nan")))
        self.result = out.to(self.dtype)
        del self.acc


class RowTopK(RowConsumer):
    """The k largest entries of every row: `values`, `indices` `[batch, head, query, min(k, key)]`."""

    def __init__(self, k: int):
        self.k = validate.integer(k, name="k", min=1)
        self.values: Tensor | None = None
        self.indices: Tensor | None = None

    def start(self, rows: PatternRows) -> None:
        self._parts: list[tuple[Tensor, Tensor]] = []
        # absolute position of query row 0: the queries are the last rows of the keys (0 when every position
        # queries; DiffusionGemma's decoder: the canvas after the cached prefix)
        self.query_offset = rows.n_keys - rows.n_queries

    def consume(self, pattern: Tensor, start: int) -> None:
        self._parts.append(pattern.float().topk(min(self.k, pattern.shape[-1]), dim=-1))

    def finish(self) -> None:
        self.values = torch.cat([v for v, _ in self._parts], dim=2)
        self.indices = torch.cat([i for _, i in self._parts], dim=2)
        del self._parts


class _Register:
    """The TL hook that attaches a consumer for this forward; the activation passes unchanged."""

    def __init__(self, attn: Any, consumer: RowConsumer):
        self.attn, self.consumer = attn, consumer

    def __call__(self, tensor: Tensor, hook: Any) -> None:
        self.attn.add_row_consumer(self.consumer)

    def __repr__(self) -> str:
        return f"row_consumer({type(self.consumer).__name__})"


class _HeldRows(PatternRows):
    """Rows of a pattern that is already whole (an attention without row consumers)."""

    def __init__(self, pattern: Float[Tensor, "batch head query key"]):
        self.q = self.k = self.mask = None
        self.is_causal, self.dtype, self.pattern = False, pattern.dtype, pattern
        self.batch, self.n_heads, self.n_queries, self.n_keys = pattern.shape
        self.device = pattern.device


class _FromPattern:
    """The TL hook on `hook_pattern` that feeds a consumer the whole pattern as one chunk."""

    def __init__(self, consumer: RowConsumer):
        self.consumer = consumer

    def __call__(self, pattern: Tensor, hook: Any) -> None:
        self.consumer.start(_HeldRows(pattern))
        self.consumer.consume(pattern, 0)
        self.consumer.finish()

    def __repr__(self) -> str:
        return f"row_consumer_from_pattern({type(self.consumer).__name__})"


def row_hook(model: Any, layer: int, consumer: RowConsumer) -> tuple[str, _Register | _FromPattern]:
    """`(name, fn)` for TL's `fwd_hooks`: feed `consumer` the pattern rows of `layer` in the next forwards.

    Attention modules that cannot stream rows (the transformers-native bridge) get the same consumer on
    `hook_pattern`: the same numbers, with the full pattern of that layer held for the forward."""
    n = model.cfg.n_layers
    l = validate.index(layer, n, name="layer", what="layer")
    validate.instances([consumer], RowConsumer, name="consumer")
    attn = model.blocks[l].attn
    if not hasattr(attn, "add_row_consumer"):
        return f"blocks.{l}.attn.hook_pattern", _FromPattern(consumer)
    return f"blocks.{l}.attn.hook_rot_k", _Register(attn, consumer)


def set_query_chunk(model: Any, query_chunk: int | None = None, row_mode: str = "explicit") -> None:
    """Rows per chunk (None = from `ROW_CHUNK_BYTES`) and how z is built while consumers are attached."""
    size = None if query_chunk is None else validate.integer(query_chunk, name="query_chunk", min=1)
    mode = validate.choice(row_mode, ROW_MODES, name="row_mode")
    for block in model.blocks:
        block.attn.query_chunk, block.attn.row_mode = size, mode
