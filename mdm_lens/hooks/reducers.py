"""Streaming reducers: per-step summaries computed *inside* the hooks, so a whole trajectory is
recorded without keeping `steps × layers × heads × T²` attention floats.

Every reducer produces `[step, batch, layer, ...]` tensors (steps = the steps it was active at,
listed in `meta["steps"]`). Positions are indexed on the *final* sequence, so ARM runs, whose
sequence grows, are zero-padded on the right.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError
from mdm_lens.hooks.steps import ALL_STEPS, Steps

QuerySet = Literal["all", "prompt", "masked", "generated", "committed"]
QUERY_SETS = ("all", "prompt", "masked", "generated", "committed")


class Reducer:
    """Base: `hooks(model, state)` → TL `(name, fn)` pairs for this step; `end_step(state)` after the
    commit; `results()` → {record name: tensor}; `meta` describes axes."""

    name = "reducer"

    def __init__(self, layers: list[int] | None = None, when: Steps = ALL_STEPS):
        self.layers_arg = layers
        self.when = when
        self.steps_seen: list[int] = []

    def begin(self, model: Any, batch: int, max_pos: int, n_steps: int) -> None:
        n = model.cfg.n_layers
        self.layers = list(range(n)) if self.layers_arg is None else [l % n for l in self.layers_arg]
        self.batch, self.max_pos, self.n_steps = batch, max_pos, n_steps
        self._rows: list[dict[str, Tensor]] = []

    def active(self, state: DenoisingState) -> bool:
        return self.when.matches(state.step, state.n_steps, state.block, state.phase)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def end_step(self, state: DenoisingState) -> None:
        raise NotImplementedError

    def results(self) -> dict[str, Tensor]:
        keys = self._rows[0].keys() if self._rows else []
        return {k: torch.stack([r[k] for r in self._rows]) for k in keys}

    @property
    def meta(self) -> dict[str, Any]:
        return {"layers": self.layers, "steps": list(self.steps_seen)}

    def _pad(self, t: Tensor, dim: int) -> Tensor:
        """Right-pad a position axis to the final sequence length (ARM prefixes are shorter)."""
        missing = self.max_pos - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t, t.new_zeros(shape)], dim=dim)


def query_weights(state: DenoisingState, query: QuerySet, pos: int) -> Bool[Tensor, "batch query"]:
    """Which query rows a statistic averages over (before the commit; 'committed' is resolved later)."""
    visible = state.key_visible[:, :pos]
    if query == "all":
        rows = visible
    elif query == "prompt":
        rows = state.prompt[:, :pos] & visible
    elif query == "masked":
        rows = state.masked[:, :pos]
    elif query == "generated":
        rows = ~state.prompt[:, :pos]
    else:
        raise InputError(f"query set must be one of {QUERY_SETS}, got {query!r}.")
    return rows


class ReceivedAttention(Reducer):
    """Received attention per key, per head: `[step, batch, layer, head, key]`.

    `kind="mass"`: m_j = (1/|Q|) Σ_{i∈Q} A_ij (the paper's A^l_j; sums to 1 over keys);
    `kind="cumulative"`: α_j = Σ_{i∈Q} A_ij (Rulli / sink-aware pruning).
    Query set Q: "all" (non-pad rows), "prompt", "masked" (still masked at this step), "generated"
    (the canvas), or "committed" (the rows committed at this step, as the paper's extractor records
    them; these rows are held until the commit is known: layers × batch × heads × T × T transiently).
    """

    name = "received_attention"

    def __init__(self, layers: list[int] | None = None, query: QuerySet = "all",
                 kind: Literal["mass", "cumulative"] = "mass", when: Steps = ALL_STEPS, name: str | None = None):
        super().__init__(layers, when)
        if query not in QUERY_SETS:
            raise InputError(f"query must be one of {QUERY_SETS}, got {query!r}.")
        if kind not in ("mass", "cumulative"):
            raise InputError(f"kind must be 'mass' or 'cumulative', got {kind!r}.")
        self.query, self.kind = query, kind
        if name:
            self.name = name

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._current: dict[int, Tensor] = {}
        self._pending: dict[int, Tensor] = {}

        def make(layer: int):
            def hook(pattern: Float[Tensor, "batch head query key"], hook: Any) -> None:
                p = pattern.shape[-1]
                if self.query == "committed":
                    self._pending[layer] = pattern.detach()
                else:
                    rows = query_weights(state, self.query, p).to(pattern.dtype)
                    self._current[layer] = self._reduce(pattern.detach(), rows)
            return hook

        return [(f"blocks.{l}.attn.hook_pattern", make(l)) for l in self.layers]

    def _reduce(self, pattern: Tensor, rows: Tensor) -> Tensor:
        summed = torch.einsum("bhqk,bq->bhk", pattern.float(), rows.float())
        if self.kind == "mass":
            summed = summed / rows.sum(-1).clamp(min=1)[:, None, None]
        return summed

    def end_step(self, state: DenoisingState) -> None:
        if self.query == "committed":
            for layer, pattern in self._pending.items():
                rows = state.committed[:, : pattern.shape[-1]]
                self._current[layer] = self._reduce(pattern, rows)
            self._pending = {}
        stacked = torch.stack([self._current[l] for l in self.layers], dim=1)  # [batch, layer, head, key]
        self._rows.append({self.name: self._pad(stacked, dim=-1).cpu()})
        self.steps_seen.append(state.step)

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "query": self.query, "kind": self.kind,
                "axes": ("step", "batch", "layer", "head", "key")}


class KeyValueNorms(Reducer):
    """‖k_j‖ (post-RoPE, equal to pre-RoPE up to rounding) and ‖v_j‖ per position, per kv head:
    `key_norms`, `value_norms` `[step, batch, layer, kv_head, pos]`."""

    name = "kv_norms"

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._current: dict[tuple[str, int], Tensor] = {}

        def make(kind: str, layer: int):
            def hook(t: Float[Tensor, "batch pos kv_head d_head"], hook: Any) -> None:
                self._current[(kind, layer)] = t.detach().float().norm(dim=-1).transpose(1, 2)
            return hook

        out = []
        for l in self.layers:
            out.append((f"blocks.{l}.attn.hook_rot_k", make("key_norms", l)))
            out.append((f"blocks.{l}.attn.hook_v", make("value_norms", l)))
        return out

    def end_step(self, state: DenoisingState) -> None:
        row = {}
        for kind in ("key_norms", "value_norms"):
            stacked = torch.stack([self._current[(kind, l)] for l in self.layers], dim=1)
            row[kind] = self._pad(stacked, dim=-1).cpu()
        self._rows.append(row)
        self.steps_seen.append(state.step)

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "axes": ("step", "batch", "layer", "kv_head", "pos")}


class TopKKeys(Reducer):
    """The k most attended keys of every query: `topk_keys` (indices, -1 where absent) and
    `topk_attention` `[step, batch, layer, head, query, k]`."""

    name = "topk"

    def __init__(self, k: int = 4, layers: list[int] | None = None, when: Steps = ALL_STEPS):
        super().__init__(layers, when)
        if k <= 0:
            raise InputError(f"k must be positive, got {k}.")
        self.k = k

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._current: dict[int, tuple[Tensor, Tensor]] = {}

        def make(layer: int):
            def hook(pattern: Tensor, hook: Any) -> None:
                k = min(self.k, pattern.shape[-1])
                vals, idx = pattern.detach().float().topk(k, dim=-1)
                self._current[layer] = (vals, idx)
            return hook

        return [(f"blocks.{l}.attn.hook_pattern", make(l)) for l in self.layers]

    def end_step(self, state: DenoisingState) -> None:
        vals = torch.stack([self._current[l][0] for l in self.layers], dim=1)  # [b, layer, head, q, k]
        idx = torch.stack([self._current[l][1] for l in self.layers], dim=1)
        if vals.shape[-1] < self.k:  # a prefix shorter than k (ARM): pad the k axis
            extra = self.k - vals.shape[-1]
            vals = torch.cat([vals, vals.new_zeros(*vals.shape[:-1], extra)], -1)
            idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], extra), -1)], -1)
        vals, idx = self._pad(vals, dim=-2), self._pad(idx + 1, dim=-2) - 1  # absent query rows → -1
        self._rows.append({"topk_attention": vals.cpu(), "topk_keys": idx.cpu()})
        self.steps_seen.append(state.step)

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "k": self.k, "axes": ("step", "batch", "layer", "head", "query", "k")}


def received_attention(**kwargs: Any) -> ReceivedAttention:
    """Factory spelled as in the design sketch: `record=[received_attention(query="masked")]`."""
    return ReceivedAttention(**kwargs)
