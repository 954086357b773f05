"""A memory plan before compute: per device, the weights, the largest forward's activations, the KV caches and the
requested caches of one `generate` call, and a refusal (with the table) when a device's budget would be exceeded.

Budgets: `max_memory` given to the plan, else the one the model was loaded with (`from_pretrained(max_memory=…)`),
else what the device has: CUDA's free memory (`torch.cuda.mem_get_info`) or the host's available memory, plus the
weights already resident there (they are loaded, so they are not in the free figure). The activation figure is the
peak of live tensors of one forward and its sampler step (`mdm_lens.hooks.forward_bytes`: the largest of a block's
attention and feed-forward phases and of the logits with the sampler's per-logit buffers, which are never alive
together); KV caches and requested caches are added, as they live through the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from mdm_lens.errors import MemoryBudgetError
from mdm_lens.hooks.forward_bytes import (block_activation_bytes, head_activation_bytes,  # noqa: F401 (re-exported)
                                          carried_logit_bytes, sampler_logit_bytes)
from mdm_lens.hooks.memory import estimate_bytes, human

COLUMNS = ("weights", "streamed", "activations", "kv_cache", "caches")


@dataclass
class DeviceMemory:
    """Bytes one device needs: `streamed` is the largest offloaded module loaded onto it per call (accelerate's
    cpu/disk offload), `caches` the trajectory cache and reducer records kept there."""

    device: str
    weights: int = 0
    streamed: int = 0
    activations: int = 0
    kv_cache: int = 0
    caches: int = 0
    budget: int | None = None
    budget_source: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.streamed + self.activations + self.kv_cache + self.caches

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget


@dataclass
class MemoryPlan:
    """`model.memory_plan(...)`'s answer: `rows[device]`, `fits`, `check()` (raises with the table), `repr` a table."""

    rows: dict[str, DeviceMemory]
    batch: int
    positions: int
    steps: int
    notes: list[str] = field(default_factory=list)
    forwards: int | None = None  # the run's forwards (block samplers: `steps` per block), what caches are sized for

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.rows.values())

    def check(self) -> "MemoryPlan":
        if not self.fits:
            over = [d for d, r in self.rows.items() if not r.fits]
            raise MemoryBudgetError(f"this run would not fit on {', '.join(over)} (refused before compute):\n{self}\n"
                                    "Lower batch / gen_length, cache fewer names or steps (record reducers instead "
                                    "of hook_pattern), or offload more blocks (device_map, max_memory).")
        return self

    def __repr__(self) -> str:
        head = f"{'device':<8}" + "".join(f"{c:>13}" for c in COLUMNS) + f"{'total':>13}{'budget':>13}  fits"
        fw = "" if self.forwards in (None, self.steps) else f", forwards={self.forwards}"
        lines = [f"MemoryPlan(batch={self.batch}, positions={self.positions}, steps={self.steps}{fw})", head]
        for r in self.rows.values():
            budget = "-" if r.budget is None else human(r.budget)
            cells = "".join(f"{human(getattr(r, c)):>13}" for c in COLUMNS)
            lines.append(f"{r.device:<8}{cells}{human(r.total):>13}{budget:>13}  {'yes' if r.fits else 'NO'}"
                         + (f"  ({r.budget_source})" if r.budget_source else ""))
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _dev(d: Any) -> str:
    return f"cuda:{d}" if isinstance(d, int) else str(d)


def _bytes(module: nn.Module, seen: set[int]) -> int:
    """Parameters and buffers, each tensor once (tied embeddings are one tensor); meta tensors keep their dtype."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _placement(model: Any) -> list[tuple[str, str, str, int]]:
    """(module, where its weights live, where it computes, bytes) per entry of `hf_device_map`."""
    from mdm_lens.loading.placement import execution_device

    device_map = getattr(model, "hf_device_map", None) or {"": str(model.cfg.device)}
    seen: set[int] = set()
    out = []
    for name, dev in device_map.items():
        module = model.get_submodule(name)
        where = _dev(dev)
        run = str(execution_device(module, lambda: torch.device(where if where != "disk" else "cpu")))
        out.append((name, where, run, _bytes(module, seen)))
    return out


Extent = tuple[int, int, int, int]  # (query rows, key positions, KV-cache positions, sampled rows) of one forward


def build_plan(model: Any, batch: int, pos: int, steps: int, kv_cache: bool, cache: Any, record: Sequence[Any],
               max_memory: dict | None, settings: Any = None, extents: Sequence[Extent] | None = None,
               per_logit: int | None = None, trajectory: int = 0, carried: tuple[int, int] | None = None,
               attention_extra: Any = None, row_logit: int = 0,
               requested: tuple[int, int] | None = None) -> MemoryPlan:
    """Per device: weights where they live, the largest streamed module, and the run's peak where it computes: the
    largest of its block phases and of the head phase (never alive together: the sum over-counted small runs by
    ~15%), plus the KV caches and requested caches, which live through the whole run. `settings` (the sampler's
    resolved settings) say what the sampler allocates per logit (`forward_bytes.sampler_logit_bytes`). `extents`:
    the shapes of the run's kinds of forward (`Sampler.forward_extents`; default one forward over the canvas `pos`,
    every row sampled, the cache only with `kv_cache`): the plan is the forward whose activations plus the KV cache
    it holds are largest (SDAR's long prefill has a short cache, its block forwards a long one). `per_logit` is the
    sampler's bytes per sampled logit (`Sampler.logit_bytes`); requested caches span the canvas. `trajectory`: the
    bytes of the trajectory the run keeps (`Sampler.trajectory_bytes`), full by the last forward of every kind but
    a first one that runs once before any step (an extent with 0 sampled rows: SDAR's prefill), where it is empty.
    `carried`: bytes per logit the sampler still references while the next forward runs, (of every query row, of
    the sampled rows) (`Sampler.carried_bytes`; default `forward_bytes.carried_logit_bytes`, 0);
    `attention_extra(extent)`: the bytes a layer's attention allocates in that forward beyond the generic model
    (`Sampler.attention_extra_bytes`); `row_logit`: bytes per logit of every forward row the sampler step
    allocates besides its sampled rows' (`Sampler.row_logit_bytes`: Fast-dLLM v2's shifted copy). `requested`: the
    (forwards, canvas width) the run sizes `cache=` / `record=` for (`Sampler.run_extent`; default (steps, pos))."""
    cfg = model.cfg
    s = torch.finfo(cfg.dtype).bits // 8
    extents = list(extents) if extents else [(pos, pos, pos if kv_cache else 0, pos)]
    path = _attention_path(model, cache, record)
    # the previous step's logits (and what the sampler derived from its sampled rows) live through the next forward
    carried, carried_sampled = (carried_logit_bytes(settings, s), 0) if carried is None else carried
    per_logit = sampler_logit_bytes(settings, s) if per_logit is None else per_logit
    kv_layer = 2 * batch * cfg.n_key_value_heads * cfg.d_head * s  # bytes of one layer's k and v per position

    def phases(e: Extent) -> tuple[int, int]:
        q, k, _, sampled = e
        head = head_activation_bytes(cfg, batch, q, s, per_logit, carried, sampled, row_logit)
        extra = attention_extra(e) if attention_extra is not None else 0
        block = block_activation_bytes(cfg, batch, q, s, path, bool(e[2]), k, extra) \
            + batch * cfg.d_vocab * (q * carried + sampled * carried_sampled)
        return block, head

    def held(e: Extent) -> int:  # what lives beside that forward's activations
        return cfg.n_layers * kv_layer * e[2] + (trajectory if e[3] else 0)

    peak = max(extents, key=lambda e: max(phases(e)) + held(e))
    block, head = phases(peak)
    kv_len = peak[2]
    table: dict[str, DeviceMemory] = {}
    row = lambda d: table.setdefault(d, DeviceMemory(d))  # noqa: E731
    for name, where, run, nbytes in _placement(model):
        row(where).weights += nbytes
        if where != run:  # offloaded: loaded onto `run` for the module's forward, one module at a time
            row(run).streamed = max(row(run).streamed, nbytes)
        blocks = [i for i in range(cfg.n_layers) if name in ("", "blocks") or name == f"blocks.{i}"
                  or name.startswith(f"blocks.{i}.")]
        if blocks:
            row(run).activations = max(row(run).activations, block)
            row(run).kv_cache += len(blocks) * kv_layer * kv_len
        if name in ("", "unembed"):
            row(run).activations = max(row(run).activations, head)
    main = str(model.input_device)
    row(main).caches += trajectory if peak[3] else 0
    forwards, width = requested if requested is not None else (steps, pos)
    _requested(model, table, row, cache, record, batch, width, forwards, s, main)
    _budgets(model, table, max_memory)
    has_kv = any(e[2] for e in extents)
    notes = [] if has_kv else ["no KV cache in these settings (kv_cache='prefix'/'dual' or use_block_cache adds one)"]
    return MemoryPlan(table, batch, pos, steps, notes, forwards)


def _attention_path(model: Any, cache: Any, record: Sequence[Any]) -> str:
    """The attention path the run takes: the full explicit pattern when a cache holds `hook_pattern` /
    `hook_attn_scores`, query chunks when reducers read pattern rows, SDPA otherwise."""
    if cache is not None:
        from mdm_lens.hooks.names import expand_names
        from mdm_lens.hooks.trajectory import TrajectoryCache

        names = expand_names(model, TrajectoryCache.from_request(cache).names_arg)
        if any(n.endswith(("hook_pattern", "hook_attn_scores")) for n in names):
            return "explicit"
    return "chunked" if record else "sdpa"


def _requested(model: Any, rows: dict, row: Any, cache: Any, record: Sequence[Any], batch: int, pos: int, steps: int,
               s: int, main: str) -> None:
    cfg = model.cfg
    if cache is not None:
        from mdm_lens.hooks.names import expand_names
        from mdm_lens.hooks.trajectory import TrajectoryCache

        tc = TrajectoryCache.from_request(cache)
        names = expand_names(model, tc.names_arg)
        n = tc.when.max_count(steps) * len(tc.when.phases)
        row(str(tc.device) if tc.device is not None else main).caches += estimate_bytes(cfg, names, n, batch, pos, s)
    if record:  # per-key reducers ([step, batch, layer, head, key] fp32) bound every built-in reducer's output
        row(main).caches += len(record) * steps * batch * cfg.n_layers * cfg.n_heads * pos * 4


def _budgets(model: Any, rows: dict[str, DeviceMemory], max_memory: dict | None) -> None:
    from accelerate.utils import convert_file_size_to_int

    given = max_memory if max_memory is not None else getattr(model, "max_memory", None)
    for dev, r in rows.items():
        if given is not None:
            for key, value in given.items():
                if _dev(key) == dev:
                    r.budget, r.budget_source = convert_file_size_to_int(value), "max_memory"
            continue
        if dev.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(dev))
            r.budget, r.budget_source = free + r.weights, "free + resident weights"
        elif dev == "cpu":
            import psutil

            r.budget, r.budget_source = psutil.virtual_memory().available + r.weights, "available + resident weights"
