"""Binding hooks to denoising steps (and blocks, and phases).

    at_steps(fn, [0, 5, -1])                 # a hook that exists only at steps 0, 5 and the last
    steps(0, -1), steps(every=4), steps("first", "last"), steps(blocks=[1])
    "blocks.0.attn.hook_pattern" @ steps(0, -1)   # a cache request (see TrajectoryCache)

Negative indices count from the end of the run, as in Python. A step-bound hook is *installed* only
for the forward passes of its steps, so an attention-pattern hook at two steps does not force the
explicit attention path on the other steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, SamplerConfigError

StepSpec = int | str
PHASES = ("cond", "uncond", "encoder")  # "encoder": the bridge's prompt pass (DiffusionGemma)


@dataclass(frozen=True)
class Steps:
    """A set of denoising steps: explicit indices / "first" / "last", every k-th, and/or blocks."""

    indices: tuple[StepSpec, ...] = ()
    every: int | None = None
    blocks: tuple[int, ...] | None = None
    phases: tuple[str, ...] = ("cond",)

    def selected(self, n_steps: int) -> list[int]:
        """The steps of a run of `n_steps` this selection fires at, indices and `every=` applied (`steps(every=3)` on
        8 steps: [0, 3, 6, 7]). A `blocks=` selection depends on which step falls in which block, known only as
        the sampler runs: refused here (read the steps a record / cache really holds in its meta or `.steps`)."""
        n_steps = validate.integer(n_steps, name="n_steps", min=1)
        if self.blocks is not None:
            raise SamplerConfigError(f"steps(blocks={list(self.blocks)}) is decided per block while the sampler runs: "
                                     "its steps are not a function of n_steps. Read the steps a record holds "
                                     "(out.record_meta[name]['steps']) or a cache's `.steps` after the run.",
                                     argument="blocks", value=list(self.blocks), allowed="a selection without blocks")
        return [k for k in range(n_steps) if self._matches_step(k, n_steps)]

    def resolve(self, n_steps: int, name: str = "steps") -> set[int] | None:
        """The explicit step indices alone (None = no index given: every step, before `every=` / `blocks=` filter;
        `selected` gives the steps that fire). Two specs naming the same
        step (``steps(0, -4)`` on a 4-step run, ``steps("first", 0)``) are an error: the records and the cache
        would hold one row where two were asked for."""
        if not self.indices:
            return None
        out: dict[int, int] = {}
        for j, s in enumerate(self.indices):
            s = {"first": 0, "last": -1}.get(s, s) if isinstance(s, str) else s
            i = validate.index(s, n_steps, name=f"{name}[{j}]", what=f"step of a run of {n_steps} steps",
                               error=SamplerConfigError)
            if i in out:
                k = out[i]
                raise SamplerConfigError(
                    f"{name}[{k}]={self.indices[k]!r} and {name}[{j}]={self.indices[j]!r} both name step {i} of a "
                    f"run of {n_steps} steps; list each step once.", argument=f"{name}[{j}]",
                    value=self.indices[j], allowed="distinct steps (negative values count from the end)")
            out[i] = j
        return set(out)

    def check(self, n_steps: int, n_blocks: int | None = None, phases: Sequence[str] | None = None, *,
              what: str = "steps", unknown: str | None = None) -> None:
        """Refuse, before any compute, a selection that can never fire in this run: a step out of range or named
        twice, a block the run does not have, or only phases the sampler does not run (None: not known); explicit
        steps that `every=` would drop (the parts are intersected: such a step never fires). `unknown`: why the
        run's length is decided as it runs; `n_steps` is then the most forwards it can make, and the range error
        says so (its steps counted from the end were refused before)."""
        if unknown is not None:
            self._check_bound(n_steps, what, unknown)
        # generate's hook_steps= names its own entries; a hook / record / cache prefixes its steps(...)
        try:
            chosen = self.resolve(n_steps, "hook_steps" if what == "hook_steps" else "steps")
        except SamplerConfigError as e:
            if what in ("hook_steps", "steps"):
                raise
            raise SamplerConfigError(f"{what}: {e}", argument=e.argument, value=e.value, allowed=e.allowed) from None
        if chosen is not None and self.every is not None:
            # a run of unknown length has no known last step: n_steps is its bound, not a step every= adds
            grid = [k for k in range(n_steps) if k % self.every == 0 or (k == n_steps - 1 and unknown is None)]
            off = sorted(k for k in chosen if k not in grid)
            if off:
                shown = grid if len(grid) <= 12 else grid[:6] + ["…"] + grid[-3:]
                raise SamplerConfigError(
                    f"{what}: steps {off} are not on every={self.every}'s grid {shown} (indices and every= are "
                    "intersected, so they would never fire); drop every= or name steps on its grid.",
                    argument="every", value=self.every, allowed=f"steps on the grid {shown}, or no every=")
        if n_blocks is not None and self.blocks is not None:
            for j, b in enumerate(self.blocks):
                if b >= n_blocks:
                    raise SamplerConfigError(
                        f"{what}: blocks[{j}]={b} does not exist: this run has {n_blocks} block(s) "
                        f"({list(range(n_blocks))}).", argument="blocks", value=list(self.blocks),
                        allowed=f"blocks in [0, {n_blocks - 1}]")
        if phases is not None and not set(self.phases) & set(phases):
            raise SamplerConfigError(
                f"{what}: phases={self.phases} never run under these settings; this run's forward passes are "
                f"{tuple(phases)} (LLaDA runs 'uncond' only with cfg_scale > 0; DiffusionGemma's prompt pass is "
                "'encoder').", argument="phases", value=self.phases, allowed=f"a subset of {tuple(phases)}")

    def _check_bound(self, n_steps: int, what: str, unknown: str) -> None:
        for j, s in enumerate(self.indices):
            if isinstance(s, int) and not isinstance(s, bool) and s >= n_steps:
                raise SamplerConfigError(
                    f"{what}: steps[{j}]={s} is invalid: expected a step in [0, {n_steps - 1}]. This run makes at "
                    f"most {n_steps} forwards and decides how many as it runs ({unknown}), so steps counted from "
                    "the end are refused too.", argument=f"steps[{j}]", value=s, allowed=f"steps in [0, {n_steps - 1}]")

    def matches(self, step: int, n_steps: int, block: int = 0, phase: str = "cond") -> bool:
        return (phase in self.phases and self._matches_step(step, n_steps)
                and (self.blocks is None or block in self.blocks))

    def _matches_step(self, step: int, n_steps: int) -> bool:
        """The step filters alone (indices and every-k), without blocks and phases."""
        chosen = self.resolve(n_steps)
        if chosen is not None and step not in chosen:
            return False
        return self.every is None or step % self.every == 0 or step == n_steps - 1

    def max_count(self, n_steps: int) -> int:
        """How many steps of a run can match: an upper bound, since which step falls in which block is
        only known while the sampler runs (used to size a cache before the run)."""
        return sum(self._matches_step(s, n_steps) for s in range(n_steps))

    def __rmatmul__(self, names: Any) -> "CacheRequest":
        return CacheRequest(names, self)


def steps(*indices: StepSpec, every: int | None = None, blocks: Iterable[int] | None = None,
          phases: Sequence[str] = ("cond",)) -> Steps:
    """`steps(0, -1)`, `steps("first", "last")`, `steps(every=4)` (the last step is always included),
    `steps(blocks=[0])`; `phases=("cond", "uncond")` to also fire on the CFG unconditional pass."""
    seen: dict[Any, int] = {}
    for j, s in enumerate(indices):
        if isinstance(s, str):
            validate.choice(s, ("first", "last"), name=f"steps[{j}]", error=SamplerConfigError)
        else:
            validate.integer(s, name=f"steps[{j}]")
        if s in seen:  # the same spec twice; aliases (0 and -n) are caught when the run's length is known
            raise SamplerConfigError(f"steps[{seen[s]}] and steps[{j}] are both {s!r}; list each step once.",
                                     argument=f"steps[{j}]", value=s, allowed="distinct steps")
        seen[s] = j
    if every is not None:
        every = validate.integer(every, name="every", min=1, error=SamplerConfigError)
    if blocks is not None:
        if _is_int(blocks):
            blocks = [blocks]
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
            raise ArgumentTypeError(f"blocks={validate.describe(blocks)} must be a block index or a list of them.",
                                    argument="blocks", value=blocks, allowed="an int >= 0 or a list of them")
        blocks = [validate.integer(b, name=f"blocks[{j}]", min=0, error=SamplerConfigError)
                  for j, b in enumerate(list(blocks))]
        if not blocks:
            raise SamplerConfigError("blocks=[] selects no block; leave blocks=None for every block.",
                                     argument="blocks", value=blocks, allowed="at least one block index")
        if len(set(blocks)) != len(blocks):
            raise SamplerConfigError(f"blocks={blocks} names a block twice; list each block once.",
                                     argument="blocks", value=blocks, allowed="distinct blocks")
    if isinstance(phases, str):
        phases = (phases,)
    if not isinstance(phases, (list, tuple)):
        raise ArgumentTypeError(f"phases={validate.describe(phases)} must be a phase name or a tuple of them.",
                                argument="phases", value=phases, allowed=f"a subset of {PHASES}")
    phases = tuple(validate.choice(p, PHASES, name="phases", error=SamplerConfigError) for p in phases)
    if not phases:
        raise SamplerConfigError("phases=() selects no forward pass; use ('cond',), ('uncond',) or both.",
                                 argument="phases", value=phases, allowed="a non-empty subset of ('cond', 'uncond')")
    if len(set(phases)) != len(phases):
        raise SamplerConfigError(f"phases={phases} names a phase twice.", argument="phases", value=phases,
                                 allowed="distinct phases")
    return Steps(tuple(indices), every, tuple(blocks) if blocks is not None else None, phases)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_steps(value: Any, *, name: str = "hook_steps") -> Steps:
    """None (every step), a `Steps`, a step (int, "first"/"last") or a non-empty list / tuple / range of steps;
    an empty one (`hook_steps=[]`) is a SamplerConfigError, never "every step"."""
    if value is None:
        return ALL_STEPS
    if isinstance(value, Steps):
        return value
    if _is_int(value) or isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple, range)):
        raise ArgumentTypeError(f"{name}={validate.describe(value)} must be None, a step, a list of steps "
                                "or steps(...).", argument=name, value=value,
                                allowed="None, int, 'first'/'last', a list of them, or steps(...)")
    if len(value) == 0:  # an empty list would mean "every step" to steps(); refused rather than guessed
        raise SamplerConfigError(f"{name}={validate.describe(value)} selects no step; pass None for every step, or "
                                 "the steps to hook.", argument=name, value=value, allowed="None or at least one step")
    return steps(*value)


ALL_STEPS = Steps()


@dataclass(frozen=True)
class CacheRequest:
    names: Any  # a hook name, a glob ("blocks.*.attn.hook_pattern"), a list of them, or a filter function
    steps: Steps


@dataclass
class StepHook:
    """A TL forward hook `(name, fn)` that exists only at the steps in `when` (the same public attribute as a
    reducer's and a TrajectoryCache's `.when`; `hook.when.selected(n_steps)` gives the steps it fires at)."""

    name: Any
    fn: Callable
    when: Steps


def at_steps(fn: Callable, step_list: Iterable[StepSpec] | Steps | None = None, *, name: Any = None,
             every: int | None = None, blocks: Iterable[int] | None = None) -> Any:
    """Bind a hook function to steps. With `name`, returns a `StepHook` to pass in `fwd_hooks`;
    without, returns a wrapper to pair with a name: `fwd_hooks=[(name, at_steps(fn, [0, -1]))]`."""
    if not callable(fn):
        raise ArgumentTypeError(f"at_steps needs a hook function first, got {validate.describe(fn)}.",
                                argument="fn", value=fn, allowed="a callable fn(tensor, hook)")
    if isinstance(step_list, Steps):
        if every is not None or blocks is not None:
            raise SamplerConfigError("at_steps(fn, steps(...), every=/blocks=): give every= and blocks= inside "
                                     "steps(...).", argument="every", value=every, allowed="None with a Steps")
        when = step_list
    elif step_list is None:
        when = steps(every=every, blocks=blocks)
    elif _is_int(step_list) or isinstance(step_list, str):
        when = steps(step_list, every=every, blocks=blocks)
    elif isinstance(step_list, (list, tuple, range)):
        if len(step_list) == 0:  # as hook_steps=[]: steps() of nothing would read "every step"
            as_steps(step_list, name="step_list")
        when = steps(*step_list, every=every, blocks=blocks)
    else:
        raise ArgumentTypeError(f"at_steps: step_list={validate.describe(step_list)} must be a step, a list of "
                                "steps or steps(...).", argument="step_list", value=step_list,
                                allowed="int, 'first'/'last', a list of them, or steps(...)")
    if name is not None:
        return StepHook(name, fn, when)
    return BoundHook(fn, when)


@dataclass
class BoundHook:
    """A hook function bound to steps, to pair with a name: `(name, at_steps(fn, [0, -1]))`. `.when` holds its
    steps. Outside `generate` and `GenerateOutput.replay` (no denoising state) `run_with_hooks` refuses it, as the
    named form (a plain forward has no step); bound to every step it hooks every forward."""

    fn: Callable
    when: Steps

    def __call__(self, tensor: Any, hook: Any) -> Any:
        return self.fn(tensor, hook=hook)


_Bound = BoundHook  # the former private name
