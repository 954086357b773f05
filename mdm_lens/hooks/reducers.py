"""Streaming reducers: per-step summaries computed *inside* the hooks, so a whole trajectory is
recorded without keeping `steps × layers × heads × T²` attention floats.

The pattern reducers (`ReceivedAttention`, `TopKKeys`) attach row consumers (`mdm_lens.pattern_rows`)
instead of hooking `hook_pattern`: the attention then computes the pattern a query chunk at a time and
never holds a whole `[batch, head, T, T]` (unless another hook asks for the pattern, when they read the
full hooked pattern as before). `received_by_layer` is the same statistic for one plain forward
(what absorption needs).

Every reducer produces `[step, batch, layer, ...]` tensors (steps = the steps it was active at,
listed in `meta["steps"]`). Positions are indexed on the *final* sequence, so ARM runs, whose
sequence grows, are zero-padded on the right.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import ArgumentTypeError, InputError, SamplerConfigError
from mdm_lens.hooks.key_positions import key_end, moved_keys, place_keys
from mdm_lens.hooks.steps import ALL_STEPS, Steps, as_steps
from mdm_lens.pattern_rows import ColumnSums, PatternRows, RowConsumer, RowTopK, chunk_rows, row_hook

QuerySet = Literal["all", "prompt", "masked", "generated", "committed"]
QUERY_SETS = ("all", "prompt", "masked", "generated", "committed")


class Reducer:
    """Base: `hooks(model, state)` → TL `(name, fn)` pairs for this step; `end_step(state)` after the
    commit; `results()` → {record name: tensor}; `meta` describes axes."""

    name = "reducer"

    def __init__(self, layers: list[int] | None = None, when: Steps = ALL_STEPS):
        # the types now; the range (negative layers count from the end) once the model is known, in `begin`
        _layer_types(layers)
        self.layers_arg = layers
        self.when = as_steps(when, name="when")
        if "cond" not in self.when.phases:
            raise SamplerConfigError(
                f"{type(self).__name__}(when=steps(phases={self.when.phases})): reducers summarise each step's "
                "conditional forward ('cond') only; record other phases with cache=name @ steps(phases=...).",
                argument="when", value=self.when.phases, allowed="phases=('cond',)")
        if set(self.when.phases) - {"cond"}:
            raise SamplerConfigError(
                f"{type(self).__name__}(when=steps(phases={self.when.phases})): a reducer records one row per step, "
                "from the conditional forward; drop the other phases (cache=name @ steps(phases=...) records them).",
                argument="when", value=self.when.phases, allowed="phases=('cond',)")
        self.steps_seen: list[int] = []
        self.no_forward: list[int] = []

    def begin(self, model: Any, batch: int, max_pos: int, n_steps: int) -> None:
        n = model.cfg.n_layers
        self.layers = validate.indices(self.layers_arg, n, name="layers", what=f"layer of {n}")
        self.batch, self.max_pos, self.n_steps = batch, max_pos, n_steps
        self.n_heads, self.n_kv_heads = model.cfg.n_heads, model.cfg.n_kv_heads or model.cfg.n_heads
        self._rows: list[dict[str, Tensor]] = []
        # each run's record lists its own steps: a reducer reused across generate calls (a loop over prompts)
        # would otherwise carry the previous run's steps into this run's meta, misaligned with its rows
        self.steps_seen = []
        self.no_forward: list[int] = []  # scheduled steps that ran no forward (`StepRunner.no_forward`)

    def active(self, state: DenoisingState) -> bool:
        return self.when.matches(state.step, state.n_steps, state.block, state.phase)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def end_step(self, state: DenoisingState) -> None:
        raise NotImplementedError

    def results(self) -> dict[str, Tensor]:
        if not self._rows:  # no scheduled step ran a forward: the record is kept, with no step row (readers say why)
            return self.empty_results()
        return {k: torch.stack([r[k] for r in self._rows]) for k in self._rows[0].keys()}

    def empty_results(self) -> dict[str, Tensor]:
        """The record of a run in which none of this reducer's steps ran a forward: each tensor with 0 step rows
        (a reducer that does not say its shapes records nothing)."""
        return {}

    @property
    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"layers": self.layers, "steps": list(self.steps_seen)}
        if self.no_forward:  # why some (or all) scheduled steps have no row
            meta["no_forward"] = list(self.no_forward)
        return meta

    def _pad(self, t: Tensor, dim: int, value: float | int = 0) -> Tensor:
        """Right-pad a position axis to the final sequence length (ARM prefixes are shorter)."""
        missing = self.max_pos - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t, t.new_full(shape, value)], dim=dim)


def query_window(state: DenoisingState, per_position: Tensor, n_queries: int | None) -> Tensor:
    """The query rows a forward computed: all positions, or, on a forward of some rows (`state.query_rows`: a block,
    a KV-cached window, a replay's prefix), the rows `[start, start + n_queries)` of the per-position tensor."""
    if n_queries is None or state.query_rows is None:
        return per_position
    q0 = state.rows.start
    return per_position[:, q0:q0 + n_queries]


def query_weights(state: DenoisingState, query: QuerySet, pos: int,
                  n_queries: int | None = None) -> Bool[Tensor, "batch query"]:
    """Which query rows a statistic averages over (before the commit; 'committed' is resolved later)."""
    return query_window(state, _query_set(state, query, pos), n_queries)


def _query_set(state: DenoisingState, query: QuerySet, pos: int) -> Bool[Tensor, "batch pos"]:
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
    them; each layer's q, k and mask are held until the commit is known, then only the committed rows
    are recomputed: linear memory, not layers × batch × heads × T × T).
    The pattern is read a query chunk at a time (see the module docstring).
    """

    name = "received_attention"

    def __init__(self, layers: list[int] | None = None, query: QuerySet = "all",
                 kind: Literal["mass", "cumulative"] = "mass", when: Steps = ALL_STEPS, name: str | None = None):
        super().__init__(layers, when)
        self.query = validate.choice(query, QUERY_SETS, name="query", error=InputError)
        self.kind = validate.choice(kind, ("mass", "cumulative"), name="kind", error=InputError)
        if name is not None:
            self.name = _record_name(name)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._consumers: dict[int, RowConsumer] = {}
        for layer in self.layers:
            if self.query == "committed":  # the rows are known only after the commit: keep the layer's q, k
                self._consumers[layer] = _KeepRows()
            else:
                # the query set over canvas positions up to the forward's last key (rows are picked at their
                # absolute positions, which need not start at 0: a BD3LM window)
                self._consumers[layer] = ColumnSums(
                    lambda rows: query_weights(state, self.query, key_end(state, rows.n_keys), rows.n_queries),
                    kind=self.kind)
        return [row_hook(model, l, c) for l, c in self._consumers.items()]

    def _committed(self, rows: PatternRows, state: DenoisingState) -> Tensor:
        """The committed rows' statistic, recomputing only those rows (in bounded chunks)."""
        weights = query_window(state, state.committed[:, : key_end(state, rows.n_keys)],
                               rows.n_queries).to(rows.device)
        sums = ColumnSums(lambda _: weights, kind=self.kind)
        sums.start(rows)
        index = weights.any(0).nonzero().flatten()
        size = chunk_rows(rows.batch, rows.n_heads, rows.n_queries, rows.n_keys)
        for part in index.split(size):
            sums.add(rows.select(part), weights[:, part])
        sums.finish()
        return sums.result

    def end_step(self, state: DenoisingState) -> None:
        current = {}
        for layer, c in self._consumers.items():
            if isinstance(c, _KeepRows):
                current[layer] = self._committed(_ran(c.rows, layer), state)
            else:
                current[layer] = _ran(c.result, layer)
        self._consumers = {}
        # [b, layer, head, key]; a position that is no key of this forward (a later block, an ARM prefix's future,
        # a slid window's past) received nothing because it did not exist: NaN, which the probes read as invisible
        # (a 0 would enter their z-scores and floors as a key that got no attention)
        stacked = place_keys(torch.stack([current[l] for l in self.layers], dim=1), state, fill=float("nan"))
        self._rows.append({self.name: self._pad(stacked, dim=-1, value=float("nan")).cpu()})
        self.steps_seen.append(state.step)

    def empty_results(self) -> dict[str, Tensor]:
        return {self.name: torch.zeros(0, self.batch, len(self.layers), self.n_heads, self.max_pos)}

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "query": self.query, "kind": self.kind,
                "axes": ("step", "batch", "layer", "head", "key")}


class KeyValueNorms(Reducer):
    """‖k_j‖ (post-RoPE, equal to pre-RoPE up to rounding) and ‖v_j‖ per position, per kv head:
    `key_norms`, `value_norms` `[step, batch, layer, kv_head, pos]`.

    Layers with fewer kv heads than the widest (DiffusionGemma's global and sliding layers differ) are NaN on the
    missing heads (`meta["kv_heads"]` lists each layer's count); positions a step has no key for (an ARM
    prefix not grown yet) are NaN, not a norm of 0.

    On a KV-cached run (`kv_cache="prefix"|"dual"`) a step's norms are those of the keys/values its forward really
    attends to: the window's fresh rows, and at every other position the cached rows (computed at the block's
    refresh forward; `mdm_lens.kvcache.LayerKV.attended`). The cache age of each position is recorded beside
    them as `kv_age` `[step, pos]` (the step whose forward computed that position's keys/values; the window's
    rows: the step itself; `state.extra["kv_age"]`)."""

    name, record_keys = "kv_norms", ("key_norms", "value_norms", "kv_age")  # fixed keys, whatever its name

    def __init__(self, layers: list[int] | None = None, when: Steps = ALL_STEPS, name: str | None = None):
        super().__init__(layers, when)
        if name is not None:
            self.name = _record_name(name)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._current: dict[tuple[str, int], Tensor] = {}

        self._age = state.extra.get("kv_age")

        def make(kind: str, layer: int):
            def hook(t: Float[Tensor, "batch pos kv_head d_head"], hook: Any) -> None:
                t = attended(model, layer, t, "k" if kind == "key_norms" else "v")
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
            per_layer = [self._current[(kind, l)] for l in self.layers]  # [batch, kv_head, pos] each
            self.kv_heads = [t.shape[1] for t in per_layer]
            width = max(self.kv_heads)
            # a window's keys sit at their canvas positions; NaN at positions that are not keys of this forward
            per_layer = [place_keys(t, state, float("nan")) for t in per_layer]
            n_pos = max(t.shape[-1] for t in per_layer)
            stacked = per_layer[0].new_full((per_layer[0].shape[0], len(per_layer), width, n_pos), float("nan"))
            for i, t in enumerate(per_layer):
                stacked[:, i, : t.shape[1], : t.shape[2]] = t
            row[kind] = self._pad(stacked, dim=-1, value=float("nan")).cpu()
        if self._age is not None:  # a cached run: the step each position's keys/values were computed at
            row["kv_age"] = self._pad(self._age.detach().clone(), dim=-1, value=-1).cpu()
        self._rows.append(row)
        self.steps_seen.append(state.step)

    def empty_results(self) -> dict[str, Tensor]:
        shape = (0, self.batch, len(self.layers), self.n_kv_heads, self.max_pos)
        return {"key_norms": torch.zeros(shape), "value_norms": torch.zeros(shape)}

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "kv_heads": list(getattr(self, "kv_heads", [])),
                "axes": ("step", "batch", "layer", "kv_head", "pos"), "record_axes": {"kv_age": ("step", "pos")}}


ABSENT_KEY = torch.iinfo(torch.int64).min  # TopKKeys' index where there is no k-th key: never a valid index


class TopKKeys(Reducer):
    """The k most attended keys of every query: `topk_keys` (key positions) and `topk_attention`
    `[step, batch, layer, head, query, k]`.

    Where a query has fewer than k keys it can attend to (an ARM prefix shorter than k, a causal query early in
    the sequence, pad keys, query rows that do not exist at a step), the missing entries are `ABSENT_KEY`
    (= `TopKKeys.ABSENT`, the most negative int64: indexing with it raises, unlike -1) in `topk_keys` and NaN
    in `topk_attention`. `k` larger than the run's whole sequence is an error (checked before the run).

    On a KV-cached run the query rows are the window's (`state.query_rows`: the other rows of that
    step are absent) and the keys are the ones the forward attends to (cached outside the window, fresh in it):
    `topk_keys` are absolute key positions."""

    name, record_keys = "topk", ("topk_attention", "topk_keys")  # fixed keys, whatever its name
    ABSENT = ABSENT_KEY

    def __init__(self, k: int = 4, layers: list[int] | None = None, when: Steps = ALL_STEPS,
                 name: str | None = None):
        super().__init__(layers, when)
        self.k = validate.integer(k, name="k", min=1, error=InputError)
        if name is not None:
            self.name = _record_name(name)

    def begin(self, model: Any, batch: int, max_pos: int, n_steps: int) -> None:
        super().begin(model, batch, max_pos, n_steps)
        if self.k > max_pos:
            raise InputError(f"TopKKeys(k={self.k}) asks for more keys than this run's sequence has ({max_pos}); "
                             f"use k <= {max_pos}.", argument="k", value=self.k, allowed=f"1 <= k <= {max_pos}")
        self.causal = getattr(model.cfg, "attention", None) == "causal"

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        self._consumers = {layer: RowTopK(self.k) for layer in self.layers}
        return [row_hook(model, l, c) for l, c in self._consumers.items()]

    def end_step(self, state: DenoisingState) -> None:
        tops = [self._consumers[l] for l in self.layers]
        self._consumers = {}
        vals = torch.stack([_ran(t.values, l) for t, l in zip(tops, self.layers)], dim=1)  # [b, layer, head, q, k]
        idx = torch.stack([t.indices for t in tops], dim=1)
        # queries that are a suffix of the keys sit at their absolute positions; a cached window (the dual cache's
        # block is not a suffix) starts where the sampler says
        n_keys = tops[0].query_offset + vals.shape[-2]
        offset = state.rows.start if state.query_rows is not None else tops[0].query_offset
        # keys a query cannot attend to (pads, a causal query's future) come out of topk with weight 0: absent
        visible, where = state.key_visible, moved_keys(state, n_keys)
        if where is not None and visible is not None:  # column c of a window's keys is canvas position where[c]
            visible = visible[:, where.to(visible.device)]
        if visible is not None and visible.shape[-1] >= n_keys:
            seen = visible[:, :n_keys].to(idx.device)[:, None, None, None, :].expand(*idx.shape[:-1], n_keys)
            absent = ~torch.gather(seen, -1, idx)
        else:
            absent = torch.zeros_like(idx, dtype=torch.bool)
        if where is not None:
            idx = where.to(idx.device)[idx]
        if self.causal:
            query_pos = offset + torch.arange(idx.shape[-2], device=idx.device)[:, None]
            absent |= idx > query_pos
        vals = vals.masked_fill(absent, float("nan"))
        idx = idx.masked_fill(absent, ABSENT_KEY)
        if vals.shape[-1] < self.k:  # a prefix shorter than k (ARM): pad the k axis
            extra = self.k - vals.shape[-1]
            vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], extra), float("nan"))], -1)
            idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], extra), ABSENT_KEY)], -1)
        if offset:
            vals = torch.cat([vals.new_full((*vals.shape[:-2], offset, vals.shape[-1]), float("nan")), vals], dim=-2)
            idx = torch.cat([idx.new_full((*idx.shape[:-2], offset, idx.shape[-1]), ABSENT_KEY), idx], dim=-2)
        vals, idx = self._pad(vals, dim=-2, value=float("nan")), self._pad(idx, dim=-2, value=ABSENT_KEY)
        self._rows.append({"topk_attention": vals.cpu(), "topk_keys": idx.cpu()})
        self.steps_seen.append(state.step)

    def empty_results(self) -> dict[str, Tensor]:
        shape = (0, self.batch, len(self.layers), self.n_heads, self.max_pos, self.k)
        return {"topk_attention": torch.zeros(shape), "topk_keys": torch.zeros(shape, dtype=torch.long)}

    @property
    def meta(self) -> dict[str, Any]:
        return {**super().meta, "k": self.k, "axes": ("step", "batch", "layer", "head", "query", "k")}


def _layer_types(layers: Any) -> None:
    """The type of a `layers=` argument, before the model (and so the range) is known."""
    if layers is None or isinstance(layers, (range, slice)) or validate._is_int(layers):
        return
    if isinstance(layers, Tensor):
        validate.tensor(layers, name="layers", ndim=1, dtype="int", nonempty=False)
        layers = layers.tolist()
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)):
        raise ArgumentTypeError(f"layers={validate.describe(layers)} must be None (every layer), a layer index or a "
                                "list of them.", argument="layers", value=layers, allowed="None, int or list of int")
    for i, layer in enumerate(layers):
        if not validate._is_int(layer):
            raise ArgumentTypeError(f"layers[{i}]={validate.describe(layer)} must be an int layer index.",
                                    argument=f"layers[{i}]", value=layer, allowed="an int")
    if not layers:
        raise InputError("layers=[] selects no layer; leave layers=None for every layer.", argument="layers",
                         value=layers, allowed="at least one layer index")


def attended(model: Any, layer: int, rows: Tensor, which: str) -> Tensor:
    """The keys/values layer `layer`'s running forward attends to, from its new rows (a hook on `hook_rot_k` /
    `hook_v`): the rows themselves, or on a KV-cached forward the cache's sequence with these rows in it."""
    blocks = getattr(model, "blocks", None)
    kv = getattr(getattr(blocks[layer], "attn", None), "kv", None) if blocks is not None else None
    return rows if kv is None else kv.attended(rows, which)


def _record_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"name={validate.describe(name)} must be a non-empty str (the record's key).",
                                argument="name", value=name, allowed="a non-empty str")
    return name


class _KeepRows(RowConsumer):
    """Keeps the layer's `PatternRows` (q, k and mask: linear memory) for a statistic computed later."""

    rows: PatternRows | None = None

    def start(self, rows: PatternRows) -> None:
        self.rows = rows

    def consume(self, pattern: Tensor, start: int) -> None:
        pass


def _ran(value: Any, layer: int) -> Any:
    if value is None:  # a bug in a sampler, not a user error: the step's forward did not reach the layer
        raise RuntimeError(f"layer {layer}'s attention ran no forward with this step's reducer attached.")
    return value


def received_attention(**kwargs: Any) -> ReceivedAttention:
    """Factory spelled as in the design sketch: `record=[received_attention(query="masked")]`."""
    return ReceivedAttention(**kwargs)


ForwardKind = Literal["mass", "cumulative", "visibility"]


@torch.no_grad()
def received_by_layer(model: Any, tokens: Tensor, attention_mask: Tensor | None = None, *,
                      attn_mask: Tensor | None = None, layers: Any = None, query_mask: Tensor | None = None,
                      kind: ForwardKind = "mass") -> Float[Tensor, "batch layer head key"]:
    """Received attention of one plain forward, per layer and head, in float64, never holding a pattern.

    Equals `probes.floating.received_attention(A, query_mask, key_visible=attention_mask, kind, causal)`
    on the full patterns `A` of the same forward (what absorption reduces), to float64 rounding.
    Query set: `query_mask [batch, pos]`, default the non-pad rows. `kind`: "mass" (÷|Q|), "cumulative"
    (column sums) or "visibility" (÷ the number of queries in Q that can see each key; causal models)."""
    tokens = validate.tensor(tokens, name="tokens", ndim=2, dtype="int")
    b, T = tokens.shape
    kind = validate.choice(kind, ("mass", "cumulative", "visibility"), name="kind")
    layer_list = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    key_visible = torch.ones(b, T, dtype=torch.bool, device=tokens.device)
    if attention_mask is not None:
        key_visible = validate.tensor(attention_mask, name="attention_mask", shape=(b, T)).to(tokens.device).bool()
    rows = key_visible
    if query_mask is not None:
        rows = validate.tensor(query_mask, name="query_mask", shape=(b, T), dtype="bool").to(tokens.device)
    sums = {l: ColumnSums(lambda _: rows, kind="cumulative", dtype=torch.float64) for l in layer_list}
    model.run_with_hooks(tokens, attention_mask=attention_mask, attn_mask=attn_mask, return_type=None,
                         fwd_hooks=[row_hook(model, l, c) for l, c in sums.items()])
    col = torch.stack([_ran(sums[l].result, l) for l in layer_list], dim=1)  # [batch, layer, head, key]
    w = rows.to(torch.float64)
    if kind == "cumulative":
        return col
    if kind == "mass":
        return col / w.sum(-1).clamp(min=1)[:, None, None, None]
    # |Q_j|: queries of Q that see key j (all of them, or those at or after j for a causal model)
    causal = model.cfg.attention == "causal"
    seen = w.flip(-1).cumsum(-1).flip(-1) if causal else w.sum(-1, keepdim=True).expand(b, T)
    seen = (seen * key_visible)[:, None, None, :]
    return torch.where(seen > 0, col / seen.clamp(min=1), torch.zeros_like(col))
