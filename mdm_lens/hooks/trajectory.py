"""`TrajectoryCache`: full activations for chosen hook names at chosen denoising steps.

    cache = TrajectoryCache("blocks.0.attn.hook_pattern", steps(0, -1))
    out = model.generate(prompt, ..., cache=cache)          # or cache="blocks.0.attn.hook_pattern" @ steps(0, -1)
    out.cache[0]                  # TransformerLens ActivationCache of step 0
    out.cache[-1]                 # of the run's last step (negative steps count from the run's end, as steps(-1))
    out.cache.stack("blocks.0.attn.hook_pattern")     # [step, batch, head, query, key]
    out.cache[0, "uncond"]        # the CFG pass of step 0, for a request with steps(phases=("cond", "uncond"))

Each phase a request names (`steps(phases=...)`: "cond", LLaDA's "uncond", DiffusionGemma's "encoder") is cached
separately; `cache[step]` / `stack(name)` read the "cond" forward when it was requested, else the one phase
requested (give `phase=` / `cache[step, phase]` when several are). A phase the run never makes is refused
before the run.

Rows and positions: a forward may compute only some canvas positions (SDAR / Fast-dLLM v2 blocks, LLaDA2's growing
prefix, Fast-dLLM `kv_cache` windows, ARM prefixes; `DenoisingState.query_rows` / `key_cols`). The cache keeps,
with each cached step, the positions of its rows and keys and the step's non-pad set (`rows_of(step)`,
`keys_of(step)`, `computed(...)`, `visible(...)`). `stack(name)` never puts different positions under one index:
when every step's rows start at position 0 it stacks as before (rows of different lengths need `pad_value`, which
right-pads, i.e. aligns by position); when rows start elsewhere (a block, a window) it refuses, naming each step's
positions, unless `align=True`: then the result is canvas-shaped, `[step, batch, pos, ...]` (attention patterns
`[step, batch, head, query pos, key pos]`), holding each step's rows at their positions and NaN where that step
computed no row (or no key column).

The bytes it will need are estimated before the run and the run is refused (MemoryBudgetError) if
they exceed `budget_bytes`.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor
from transformer_lens import ActivationCache

from mdm_lens.diffusion.state import DenoisingState
from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError
from mdm_lens.hooks import shape_probe
from mdm_lens.hooks.memory import cache_budget, check_budget, human, is_dense_hook
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.steps import ALL_STEPS, CacheRequest, Steps


class TrajectoryCache:
    def __init__(self, names: Any, steps: Steps = ALL_STEPS, budget_bytes: int | None = None,
                 device: str | torch.device | None = "cpu"):
        from mdm_lens.hooks.steps import as_steps

        ok = callable(names) or isinstance(names, str) or (
            isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names))
        if not ok:
            raise ArgumentTypeError(f"TrajectoryCache names={validate.describe(names)} must be a hook name, a glob, a "
                                    "non-empty list of them or a filter function.", argument="names", value=names,
                                    allowed="str, list of str or callable")
        self.names_arg, self.when = names, as_steps(steps, name="steps")
        # None: MDM_LENS_CACHE_BUDGET_GB as it is now, else 4 GiB
        self.budget_bytes, self.budget_source = (cache_budget() if budget_bytes is None else
                                                 (validate.integer(budget_bytes, name="budget_bytes", min=1),
                                                  "budget_bytes"))
        self.device = None if device is None else validate.storage_device(device, name="device")
        self.names: list[str] = []
        self._phases: dict[str, dict[int, dict[str, Tensor]]] = {}
        # per phase and step: (query rows, key columns, canvas width, non-pad set [batch, pos]) of its forward
        self._where: dict[str, dict[int, tuple[slice, slice, int, Tensor]]] = {}
        # variable-length runs (DreamOn, InDel): per phase and step, the original position of each row (−1 inserted)
        self._origin: dict[str, dict[int, Tensor]] = {}
        # per phase and step whose keys are not one run of positions (`DenoisingState.key_index`): their positions
        self._key_index: dict[str, dict[int, Tensor]] = {}
        self.estimated_bytes = 0
        self.model: Any = None
        # the run's number of steps, for negative indices (as steps(-1), state_at(-1)): the plan's at `begin`,
        # the run's actual count once its GenerateOutput holds this cache (adaptive runs stop early)
        self.n_run: int | None = None
        # the run's canvas width (set by its GenerateOutput): align=True stacks are this wide on fixed-length runs
        self.canvas_width: int | None = None

    @classmethod
    def from_request(cls, request: Any) -> "TrajectoryCache":
        if isinstance(request, TrajectoryCache):
            return request
        if isinstance(request, CacheRequest):
            return cls(request.names, request.steps)
        return cls(request)  # names only: every step

    def begin(self, model: Any, batch: int, max_pos: int, n_steps: int) -> None:
        self.model = model
        self.names = expand_names(model, self.names_arg)
        self.n_run = n_steps
        # blocks are only known during the run: an upper bound; each cached phase is a forward of its own
        n_cached = self.when.max_count(n_steps) * len(self.when.phases)
        dtype_bytes = torch.finfo(model.cfg.dtype).bits // 8
        # hooks outside the dense surface (MoE routing and experts, q/k norms, a new family's own) are measured
        # on the model with two tiny forwards, so every hook point can be cached with an honest estimate
        others = [n for n in self.names if not is_dense_hook(n)]
        itemsize: dict[str, int] = {}
        measured = shape_probe.measure(model, others, itemsize) if others else {}
        self.estimated_bytes = check_budget(model.cfg, self.names, n_cached, batch, max_pos, dtype_bytes,
                                            self.budget_bytes, measured, itemsize, self.budget_source)
        self._phases = {p: {} for p in self.when.phases}
        self._where = {p: {} for p in self.when.phases}
        self._origin = {p: {} for p in self.when.phases}
        self._key_index = {p: {} for p in self.when.phases}

    def active(self, state: DenoisingState) -> bool:
        return self.when.matches(state.step, state.n_steps, state.block, state.phase)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        store = self._phases.setdefault(state.phase, {}).setdefault(state.step, {})
        self._where.setdefault(state.phase, {})[state.step] = (state.rows, state.keys, int(state.x.shape[1]),
                                                               state.key_visible.detach().bool().cpu())
        if state.key_index is not None:
            self._key_index.setdefault(state.phase, {})[state.step] = state.key_index.detach().cpu()
        if state.variable_length:  # slot ids: two inserted rows share origin −1 but are different tokens
            self._origin.setdefault(state.phase, {})[state.step] = state.slot.detach().cpu()
            self._n_original = int(state.n_original)

        def save(tensor: Tensor, hook: Any) -> None:
            store[hook.name] = tensor.detach().to(self.device)

        return [(name, save) for name in self.names]

    # --- access -------------------------------------------------------------------------------------
    @property
    def phases(self) -> tuple[str, ...]:
        """The phases this cache records (`steps(phases=...)` of its request)."""
        return tuple(self.when.phases)

    def _phase(self, phase: str | None) -> str:
        if phase is not None:
            return validate.choice(phase, self.phases, name="phase", error=InputError)
        if "cond" in self.phases:
            return "cond"
        if len(self.phases) == 1:
            return self.phases[0]
        raise InputError(f"this cache holds phases {self.phases}; name one: phase=... or cache[step, phase].",
                         argument="phase", value=None, allowed=f"one of {self.phases}")

    def _store(self, phase: str | None) -> dict[int, dict[str, Tensor]]:
        return self._phases.get(self._phase(phase), {})

    @property
    def steps(self) -> list[int]:
        """The cached steps of the default phase ("cond" when requested, else the only phase)."""
        return sorted(self._store(None))

    def steps_of(self, phase: str) -> list[int]:
        return sorted(self._store(phase))

    def __len__(self) -> int:
        return len(self._store(None))

    def __iter__(self) -> Iterator[int]:
        """The cached steps (of the default phase), as a dict's keys: `for step in cache: cache[step]`."""
        return iter(self.steps)

    def __contains__(self, key: Any) -> bool:
        """A cached step (negative: from the run's end) or a cached hook name."""
        if isinstance(key, str):
            return key in self.names
        try:
            self._cached_step(key, self.steps)
        except ArgumentError:  # not an int, out of the run's range, or not cached
            return False
        return True

    def _cached_step(self, step: Any, cached: list[int]) -> int:
        """`step` as a cached step number: an int, negative counting from the end of the run (as steps(-1),
        state_at and tracer.iter count, not from the last cached step)."""
        if not validate._is_int(step):
            raise ArgumentTypeError(f"step {validate.describe(step)}: a step is an int (negative counts from the "
                                    "run's last step).", argument="step", value=step, allowed="an int")
        step = int(step)
        if step < 0:
            n = self.n_run
            if n is None or not -n <= step:
                raise OutOfRangeError(f"step {step}: the run had {n if n is not None else 'no'} step(s); cached "
                                      f"steps: {cached}.", argument="step", value=step,
                                      allowed=f"[-{n}, -1] or a cached step" if n else "a cached step")
            step += n
        if step not in cached:
            raise InputError(f"step {step} was not cached; cached steps: {cached}.", argument="step", value=step,
                             allowed=f"one of {cached}")
        return step

    def __getitem__(self, key: int | tuple[int, str]) -> ActivationCache:
        step, phase = key if isinstance(key, tuple) and len(key) == 2 else (key, None)
        if isinstance(step, str):  # TransformerLens' cache[name, layer] habit: here the step comes first
            raise ArgumentTypeError(f"cache[{validate.describe(key)}]: a trajectory cache is indexed by step first, "
                                    f"then hook name: write cache[step][{step!r}] (or cache[step, phase][...]).",
                                    argument="step", value=step, allowed="an int step")
        if isinstance(phase, str) and phase in self.names:  # cache[step, name]: the name goes in the step's cache
            raise ArgumentTypeError(f"cache[{validate.describe(key)}]: the second index is a phase, and {phase!r} "
                                    f"is a hook name: write cache[{step!r}][{phase!r}].", argument="phase",
                                    value=phase, allowed=f"a phase ({', '.join(map(repr, self.when.phases))})")
        store = self._store(phase)
        step = self._cached_step(step, sorted(store))
        from mdm_lens.cache import MDMActivationCache  # here, not at the top: keeps this edit to one spot

        return MDMActivationCache(store[step], self.model)  # typed errors for missing names / layers

    def stack(self, name: str, pad_value: float | None = None, phase: str | None = None,
              align: bool = False) -> Tensor:
        """`[step, ...]` over the cached steps (of `phase`), rows in position order (module docstring).

        Rows that all start at position 0 stack as they are (`pad_value` right-pads prefixes of different lengths,
        e.g. ARM's), and so do rows that are the same positions (and keys) at every step (row k is position
        `rows_of(step).start + k`); rows that start elsewhere are refused unless `align=True`, which returns the
        canvas-shaped tensor with NaN where a step computed no row."""
        if name not in self.names:
            raise InputError(f"{name!r} was not cached; cached names: {self.names}.")
        validate.boolean(align, name="align")
        store = self._store(phase)
        if not store:
            raise InputError(f"no step was cached for phase {self._phase(phase)!r}.", argument="phase", value=phase,
                             allowed="a phase that ran")
        steps = sorted(store)
        tensors = [store[s][name] for s in steps]
        where = self._where.get(self._phase(phase), {})
        self._check_same_rows(name, steps, phase)
        if align:
            scattered = sorted(set(steps) & set(self._key_index.get(self._phase(phase), {})))
            if scattered and name.endswith(("hook_pattern", "hook_attn_scores")):
                raise InputError(f"{name}: steps {scattered[:6]} attend to keys that are not one run of positions (a "
                                 "KV cache that skipped an unstored block), so their key columns cannot be aligned "
                                 "to the canvas as a block; read cache[step] with cache.key_positions_of(step).",
                                 argument="align", value=align, allowed="False for these steps")
            fixed = not self._origin.get(self._phase(phase))
            return aligned(name, tensors, [where[s] for s in steps], steps,
                           self.canvas_width if fixed else None)
        moved = [(s, where[s][0]) for s in steps if s in where and where[s][0].start != 0]
        # every step computed the same rows against the same keys: row k is position rows.start + k throughout
        same = all(s in where for s in steps) and len({(where[s][0].start, where[s][0].stop, where[s][1].start,
                                                         where[s][1].stop) for s in steps}) == 1 \
            and not set(steps) & set(self._key_index.get(self._phase(phase), {}))
        if moved and not same:
            shown = ", ".join(f"step {s}: [{r.start}, {r.stop})" for s, r in
                              [(s, where[s][0]) for s in steps][:6]) + (" …" if len(steps) > 6 else "")
            raise InputError(f"{name}: the cached steps computed rows at different canvas positions ({shown}), so "
                             "row k is not the same position at every step; pass align=True for a canvas-shaped "
                             "tensor (NaN where a step computed no row), or read cache[step] with "
                             "cache.rows_of(step).", argument="align", value=align, allowed="True")
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            if pad_value is None:
                raise InputError(f"{name} has different shapes across steps ({sorted(shapes)}: the rows, all from "
                                 "position 0, grow); pass pad_value=0.0 to right-pad, or align=True (NaN pads).")
            target = [max(s[i] for s in shapes) for i in range(len(tensors[0].shape))]
            tensors = [torch.nn.functional.pad(t, [p for d in reversed(range(t.ndim))
                                                    for p in (0, target[d] - t.shape[d])], value=pad_value)
                       for t in tensors]
        return torch.stack(tensors)

    # --- positions ----------------------------------------------------------------------------------
    def origin_of(self, step: int, phase: str | None = None) -> Tensor:
        """`[batch, pos]`: the original position (step 0's canvas) of each row cached at `step`, −1 for a row
        inserted during the run; the identity for a fixed-length run."""
        step = self._resolve(step, phase)
        slot = self._origin.get(self._phase(phase), {}).get(step)
        if slot is None:
            r = self.rows_of(step, phase)
            return torch.arange(r.start, r.stop)[None]
        return torch.where(slot < self._n_original, slot, torch.full_like(slot, -1))

    def _check_same_rows(self, name: str, steps: list[int], phase: str | None) -> None:
        """A variable-length run stacks only steps whose rows are the same slots (nothing inserted or deleted
        between them); otherwise row k is a different token at different steps."""
        origins = self._origin.get(self._phase(phase), {})
        got = [(s, origins[s]) for s in steps if s in origins]
        differ = [s for s, o in got if not (o.shape == got[0][1].shape and torch.equal(o, got[0][1]))]
        if not differ:
            return
        raise InputError(f"{name}: this run inserted or deleted rows between the cached steps (step {differ[0]}'s "
                         f"rows are not step {got[0][0]}'s slots; widths {got[0][1].shape[1]} and "
                         f"{origins[differ[0]].shape[1]}), so row k is not the same token at every step and a "
                         "[step, ...] stack (padded "
                         "or aligned) would mix tokens. Read cache[step] with cache.origin_of(step) (original "
                         "position of each row, −1: inserted), or cache steps between which the length does not "
                         "change.", argument="name", value=name, allowed="steps with the same rows")

    def _where_of(self, step: int, phase: str | None) -> tuple[slice, slice, int, Tensor]:
        return self._where[self._phase(phase)][self._resolve(step, phase)]

    def _resolve(self, step: Any, phase: str | None) -> int:
        return self._cached_step(step, sorted(self._where.get(self._phase(phase), {})))

    def rows_of(self, step: int, phase: str | None = None) -> slice:
        """The canvas positions of the rows cached at `step` (row r of `cache[step][name]` is position
        `start + r`)."""
        return self._where_of(step, phase)[0]

    def keys_of(self, step: int, phase: str | None = None) -> slice:
        """The canvas positions of the key columns of `step`'s attention patterns (cached keys included): key
        column c is position `start + c`. Refused for a step whose keys are not one run of positions (read
        `key_positions_of`)."""
        step = self._resolve(step, phase)
        keys = self._where_of(step, phase)[1]
        if step in self._key_index.get(self._phase(phase), {}):
            raise InputError(f"step {step}'s keys are not one run of positions (a KV cache that skipped an unstored "
                             "block), so no slice names them; cache.key_positions_of(step) gives each key column's "
                             "position.", argument="step", value=step, allowed="a step with contiguous keys")
        return keys

    def key_positions_of(self, step: int, phase: str | None = None) -> Tensor:
        """`[keys]`: the canvas position of every key column of `step`'s attention patterns (cached keys
        included), whether or not they are one run of positions."""
        step = self._resolve(step, phase)
        keys = self._where_of(step, phase)[1]
        index = self._key_index.get(self._phase(phase), {}).get(step)
        return torch.arange(keys.start, keys.stop) if index is None else index.clone()

    def width(self, phase: str | None = None) -> int:
        """The canvas width `align=True` uses: the widest cached step's canvas."""
        return max(w[2] for w in self._where.get(self._phase(phase), {}).values())

    def computed(self, phase: str | None = None) -> Tensor:
        """`[step, batch, pos]` bool over the cached steps and the canvas: the positions each step computed a row
        at (the non-NaN rows of `stack(..., align=True)`)."""
        return self._per_step(phase, lambda r, k, w, vis: _span(r, self.width(phase)).expand(vis.shape[0], -1))

    def visible(self, phase: str | None = None) -> Tensor:
        """`[step, batch, pos]` bool: the non-pad positions of each cached step's canvas (its `key_visible`;
        False beyond a step's canvas)."""
        n = self.width(phase)
        return self._per_step(phase, lambda r, k, w, vis: torch.nn.functional.pad(vis, (0, n - vis.shape[1])))

    def _per_step(self, phase: str | None, fn: Any) -> Tensor:
        where = self._where.get(self._phase(phase), {})
        if not where:
            raise InputError(f"no step was cached for phase {self._phase(phase)!r}.", argument="phase", value=phase,
                             allowed="a phase that ran")
        return torch.stack([fn(*where[s]) for s in sorted(where)])

    def __repr__(self) -> str:
        per = {p: sorted(v) for p, v in self._phases.items()}
        shown = f"steps={per.get('cond', [])}" if set(per) <= {"cond"} else f"steps by phase={per}"
        return f"TrajectoryCache({len(self.names)} name(s), {shown}, estimated {human(self.estimated_bytes)})"



def _span(r: slice, n: int) -> Tensor:
    out = torch.zeros(1, n, dtype=torch.bool)
    out[0, r] = True
    return out


def aligned(name: str, tensors: list[Tensor], where: list[tuple[slice, slice, int, Tensor]],
            steps: list[int], canvas_width: int | None = None) -> Tensor:
    """`[step, ...]` canvas-shaped: each step's rows placed at their positions (and, for attention patterns and
    scores, its key columns at theirs), NaN elsewhere. `canvas_width`: the run's canvas, when wider than every
    forward (ARM never feeds the last token back)."""
    width = max([w[2] for w in where] + [canvas_width or 0])
    pattern = name.endswith(("hook_pattern", "hook_attn_scores"))
    row_axis = -2 if pattern else 1
    first = tensors[0]
    if not first.is_floating_point():
        raise InputError(f"{name} is {first.dtype}: align=True marks missing rows with NaN, which needs a float "
                         "tensor.", argument="align", value=True, allowed="False for this hook")
    shape = list(first.shape)
    shape[row_axis] = width
    if pattern:
        shape[-1] = width
    out = torch.full((len(tensors), *shape), float("nan"), dtype=first.dtype, device=first.device)
    for i, (t, (rows, keys, _, _)) in enumerate(zip(tensors, where)):
        n_keys = keys.stop - keys.start
        if t.shape[row_axis] != rows.stop - rows.start or (pattern and t.shape[-1] != n_keys):
            raise InputError(f"{name} at step {steps[i]} has shape {tuple(t.shape)}, which does not match the "
                             f"forward's rows [{rows.start}, {rows.stop}) and keys [{keys.start}, {keys.stop}): "
                             "this hook is not per position, so it cannot be aligned.", argument="align",
                             value=True, allowed="False for this hook")
        index: list[Any] = [i] + [slice(None)] * first.ndim
        index[row_axis if row_axis < 0 else row_axis + 1] = rows
        if pattern:
            index[-1] = keys
        out[tuple(index)] = t.to(out.dtype)
    return out
