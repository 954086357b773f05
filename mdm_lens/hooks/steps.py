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

    def resolve(self, n_steps: int) -> set[int] | None:
        """The concrete step indices (None = every step, subject to blocks/every)."""
        if not self.indices:
            return None
        out = set()
        for j, s in enumerate(self.indices):
            s = {"first": 0, "last": -1}.get(s, s) if isinstance(s, str) else s
            out.add(validate.index(s, n_steps, name=f"steps[{j}]", what=f"step of a run of {n_steps} steps",
                                   error=SamplerConfigError))
        return out

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
    for j, s in enumerate(indices):
        if isinstance(s, str):
            validate.choice(s, ("first", "last"), name=f"steps[{j}]", error=SamplerConfigError)
        else:
            validate.integer(s, name=f"steps[{j}]")
    if every is not None:
        every = validate.integer(every, name="every", min=1, error=SamplerConfigError)
    if blocks is not None:
        if isinstance(blocks, int) and not isinstance(blocks, bool):
            blocks = [blocks]
        blocks = [validate.integer(b, name=f"blocks[{j}]", min=0, error=SamplerConfigError)
                  for j, b in enumerate(validate.instances(list(blocks), int, name="blocks"))]
    if isinstance(phases, str):
        phases = (phases,)
    phases = tuple(validate.choice(p, PHASES, name="phases", error=SamplerConfigError) for p in phases)
    if not phases:
        raise SamplerConfigError("phases=() selects no forward pass; use ('cond',), ('uncond',) or both.",
                                 argument="phases", value=phases, allowed="a non-empty subset of ('cond', 'uncond')")
    return Steps(tuple(indices), every, tuple(blocks) if blocks is not None else None, phases)


ALL_STEPS = Steps()


@dataclass(frozen=True)
class CacheRequest:
    names: Any  # a hook name, a glob ("blocks.*.attn.hook_pattern"), a list of them, or a filter function
    steps: Steps


@dataclass
class StepHook:
    """A TL forward hook `(name, fn)` that exists only at the steps in `when` (the same public attribute as a
    reducer's and a TrajectoryCache's `.when`; `hook.when.resolve(n_steps)` gives the concrete step indices)."""

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
        when = step_list
    elif isinstance(step_list, (int, str)):
        when = steps(step_list, every=every, blocks=blocks)
    else:
        when = steps(*(step_list or ()), every=every, blocks=blocks)
    if name is not None:
        return StepHook(name, fn, when)
    return BoundHook(fn, when)


@dataclass
class BoundHook:
    """A hook function bound to steps, to pair with a name: `(name, at_steps(fn, [0, -1]))`. `.when` holds its
    steps. Outside `generate` and `GenerateOutput.replay` (no denoising state) it fires on every forward pass."""

    fn: Callable
    when: Steps

    def __call__(self, tensor: Any, hook: Any) -> Any:
        return self.fn(tensor, hook=hook)


_Bound = BoundHook  # the former private name
