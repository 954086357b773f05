"""The step clock behind `mdm_lens.nnsight`: an nnsight interleaver whose occurrence of every location is
the denoising step running, `tracer.iter[...]` over steps, and the gate that sends a layer's attention
down the explicit path exactly in the forwards whose pattern a trace reads."""

from __future__ import annotations

import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from greenlet import getcurrent
from nnsight.intervention.interleaver import Event, Interleaver, OutOfOrderError, dangling_unwind
from nnsight.intervention.iterator import Iterations

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError, MDMLensError, OutOfRangeError, SamplerConfigError


PHASES = ("cond", "uncond")
BEFORE = ("canvas", "masked", "prompt", "block")  # sampler values served before a step's forward
AFTER = ("confidence", "committed", "state")  # ... and after its commit
_FIELDS = {"canvas": "x"}  # sampler value -> DenoisingState field, where the names differ

class _FrozenState:
    """A read-only copy of a `DenoisingState` (assigning a field raises)."""

    def __init__(self, fields: dict) -> None:
        object.__setattr__(self, "__dict__", dict(fields))

    def __setattr__(self, name: str, value: Any) -> None:
        raise InputError(f"lm.sampler.state.{name} is read-only: the sampler's state is observed, not edited.",
                         argument=f"lm.sampler.state.{name}", value="assignment", allowed="reads only")

    def __repr__(self) -> str:
        return f"FrozenState(step={self.__dict__.get('step')}, phase={self.__dict__.get('phase')!r})"


def _frozen_state(state: Any, copies: dict) -> _FrozenState:
    fields = {}
    for k, v in vars(state).items():
        fields[k] = copies.setdefault(k, v.clone()) if isinstance(v, torch.Tensor) else v
    fields["extra"] = dict(state.extra)
    return _FrozenState(fields)


class StepNotRunError(MDMLensError, OutOfOrderError):
    """A traced value was requested at a denoising step (or phase) the run never made."""


def _phase_location(location: str, phase: str) -> str:
    """`model.blocks.0.output` -> `model.blocks.0.@uncond.output`: the same value on another forward."""
    path, _, key = location.rpartition(".")
    return f"{path}.@{phase}.{key}"


@dataclass
class _Plan:
    """What a generation will do, known before it runs (for `tracer.iter` and `phase`)."""

    n_steps: int | None  # adaptive runs: the most forwards they can make; None: not known before the run
    has_uncond: bool
    adaptive: str | None = None  # why the run's length is known only at its end (steps from the end are refused)


@dataclass
class _Run:
    """The step clock of a generation in progress."""

    plan: _Plan
    step: int = 0
    phase: str = "cond"
    clocked: bool = True
    n_run: int = 0  # steps started
    last: Any = None  # the cond DenoisingState of the step running (its post-commit fields come later)


class StepInterleaver(Interleaver):
    """nnsight's interleaver with a step clock while a generation runs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.model_ref: Any = None
        self.root_input, self.root_output = "model.input", "model.output"
        self.sampler_path = "model.sampler"
        self.keys: set[str] = set()  # every location a step can serve, for the clock reset
        self.run: _Run | None = None
        self.last_run: _Run | None = None
        self.plan: _Plan | None = None  # set by the tracer for the block being run

    def __enter__(self) -> "StepInterleaver":
        # occurrences are counted from this run's start (mediators subtract the counts they start at)
        self.counts = {}
        self.run = self.last_run = None
        return super().__enter__()

    # --- the clock ------------------------------------------------------------------------------
    def begin_run(self, plan: _Plan) -> None:
        self.run = self.last_run = _Run(plan)
        self._reset(0)

    def finish_run(self) -> None:
        run = self.run
        run.phase = "cond"
        if run.n_run:
            self._serve(run.last, AFTER)
        self._check_writes()
        self.__dict__["_watched"] = []
        run.clocked = False  # what follows (generator output, tracer.result) counts plainly

    def _reset(self, step: int) -> None:
        """No location has been visited yet in `step`: each one's next occurrence is `step`."""
        self.keys.update(self.counts)
        self.counts = dict.fromkeys(self.keys, step)

    def _forward_starts(self) -> None:
        run, state = self.run, self.model_ref().state
        if state is None or state.phase == "cond":
            step = run.n_run if state is None else state.step
            if run.n_run and step == run.step:
                raise MDMLensError(f"denoising step {step} ran a second conditional forward; the step clock "
                                   "serves one conditional forward per step (others need their own phase).")
            run.phase = "cond"
            if run.n_run:
                self._serve(run.last, AFTER)
            run.last, run.n_run = state, run.n_run + 1
            run.step = step
            self._reset(step)
            self._serve(state, BEFORE)
        else:
            run.phase = state.phase

    def _serve(self, state: Any, names: tuple[str, ...]) -> None:
        """Serve the sampler's values as copies, so a write cannot reach the run; an in-place write to a copy is
        caught (its version counter moved) and raises, as an assignment does: the envoy is read-only for real."""
        self._check_writes()
        copies = self.__dict__.setdefault("_copies", {})
        if names is BEFORE:
            copies.clear()
        for name in names:
            if name == "state":
                value = None if state is None else _frozen_state(state, copies)
            else:
                value = None if state is None else getattr(state, _FIELDS.get(name, name))
                if isinstance(value, torch.Tensor):
                    value = copies.setdefault(_FIELDS.get(name, name), value.clone())
            self._watch(name, value)
            self.handle(f"{self.sampler_path}.{name}", value)
        self._check_writes()

    def _watch(self, name: str, value: Any) -> None:
        watched = self.__dict__.setdefault("_watched", [])
        tensors = [(name, value)] if isinstance(value, torch.Tensor) else [
            (f"state.{k}", v) for k, v in vars(value).items() if isinstance(v, torch.Tensor)] if value is not None \
            and hasattr(value, "__dict__") else []
        watched.extend((n, t, t._version) for n, t in tensors)

    def _check_writes(self) -> None:
        for name, t, version in self.__dict__.get("_watched", []):
            if t._version != version:
                self.__dict__["_watched"] = []
                raise InputError(f"lm.sampler.{name} is read-only: an in-place write to it would change nothing (or "
                                 "the run); intervene on the model instead (e.g. lm.blocks[l].hook_resid_post.output).",
                                 argument=f"lm.sampler.{name}", value="in-place write", allowed="reads only")

    def handle(self, provider: str, value: Any) -> Any:
        run = self.run
        if run is None or not run.clocked:
            return super().handle(provider, value)
        if provider == self.root_input:
            self._forward_starts()
        if run.phase != "cond":
            location = _phase_location(provider, run.phase)
            value = super().handle(location if location in self.counts else self._new(location), value)
            if provider == self.root_output:
                run.phase = "cond"
            return value
        counts = self.counts
        occurrence = counts.get(provider)
        if occurrence is None:
            occurrence = counts[provider] = run.step
        if provider not in self.parked and provider not in self.observers:  # nobody waits here: count the visit
            counts[provider] = occurrence + 1
            return value
        return super().handle(provider, value)

    def _new(self, location: str) -> str:
        self.counts[location] = self.run.step
        return location

    def wants(self, locations: tuple[str, ...]) -> bool:
        """Will a worker be served at one of `locations` on this visit (or a cache record it)?"""
        run = self.run
        phase = run.phase if run is not None and run.clocked else "cond"
        for location in locations:
            if phase != "cond":
                location = _phase_location(location, phase)
            if location in self.observers:
                return True
            if location not in self.parked:
                continue
            if run is not None and run.clocked and location not in self.counts:
                self._new(location)
            for mediator in self.mediators:
                pending = mediator.pending
                if (pending is not None and pending.provider == location
                        and pending.iteration == mediator.occurrence(location)):
                    return True
        return False

    # --- what never came ------------------------------------------------------------------------
    def check_dangling_mediators(self) -> None:
        run = self.last_run
        if run is None:
            return super().check_dangling_mediators()
        for mediator in self.mediators:
            if not mediator.alive:
                continue
            error, expected = dangling_unwind(mediator)
            open_loop = getattr(mediator, "mdm_open_loop", False)
            ended_early = run.plan.n_steps is None or run.n_run < run.plan.n_steps
            if mediator.pending.event is not Event.BARRIER and not (open_loop and ended_early):
                error, expected = self._not_run(mediator.pending, run), None
            try:
                mediator.worker.throw(error)
            except BaseException as thrown:
                if expected is None or thrown is not error:
                    raise
                warnings.warn(expected)
            else:
                if expected is None:  # the block swallowed it (e.g. a `with tracer.iter` form): still an error
                    raise error

    @staticmethod
    def _not_run(pending: Any, run: _Run) -> StepNotRunError:
        location, step = pending.provider, pending.iteration
        where = f"'{location}' at denoising step {step}"
        if "@uncond" in location and not run.plan.has_uncond:
            why = "this run has no unconditional pass (LLaDA's classifier-free guidance needs cfg_scale > 0)"
        elif step is not None and step >= run.n_run:
            planned = run.plan.n_steps
            why = (f"this run has {run.n_run} denoising steps (0..{run.n_run - 1})"
                   + ("" if planned in (None, run.n_run) else f" of the {planned} planned"))
        else:
            why = (f"the run had gone past it (this run has {run.n_run} denoising steps): requests must follow the "
                   "run, steps in increasing order and modules in forward order")
        return StepNotRunError(f"{where} was never reached: {why}.")


class _AttentionGate:
    """Stands in `Attention.force_explicit` (read as a truth value by `needs_explicit`): true when the
    attention has to take the explicit path because a trace reads this layer's scores or pattern in
    this very forward — exactly the steps at which mdm_lens' own step hooks would install a hook, so
    the other steps keep the SDPA path (and the trajectory is bit-identical to the hooked run)."""

    def __init__(self, interleaver: StepInterleaver, locations: tuple[str, ...], base: Any):
        self.interleaver = weakref.ref(interleaver)
        self.locations = locations
        self.base = base

    def __bool__(self) -> bool:
        if self.base:
            return True
        il = self.interleaver()
        return bool(il is not None and il.interleaving and il.busy and il.wants(self.locations))

    def __reduce__(self) -> tuple:  # a copied or pickled model keeps the plain flag, not the trace
        return bool, (bool(self.base),)


def _clocked_wanted(self: Any, location: str) -> int:
    if self.iteration is not None:
        return self.iteration
    step = getattr(self, "mdm_step", None)
    run = getattr(self.interleaver, "run", None)
    if step is not None and run is not None and run.clocked:
        return step  # a read that comes after its module ran in this step waits for a step that never comes again
    return type(self).wanted(self, location)


def _clock_requests(mediator: Any) -> None:
    if "wanted" not in vars(mediator):
        mediator.wanted = types.MethodType(_clocked_wanted, mediator)


class StepIterations(Iterations):
    """`tracer.iter[...]` over denoising steps: indices are checked against the run's step count
    (negative ones count from the end), and `[:]` / `tracer.all()` means every step."""

    def __init__(self, plan: _Plan, start: int = 0, stop: int | None = None, steps: list[int] | None = None,
                 open_loop: bool = False):
        super().__init__(start, stop, steps)
        self.plan, self.open_loop = plan, open_loop

    def __getitem__(self, key: Any) -> "StepIterations":
        n = self.plan.n_steps
        if isinstance(key, slice):
            start = 0 if key.start is None else self._step(key.start, "tracer.iter start")
            stop = n if key.stop is None else self._stop(key.stop, key)
            stride = 1 if key.step is None else validate.integer(key.step, name="tracer.iter step", min=1)
            if stop is not None and stop <= start:
                raise OutOfRangeError(f"tracer.iter[{start}:{stop}] selects no step of this run's {n} steps.",
                                      argument="tracer.iter", value=key)
            if stride == 1:
                return StepIterations(self.plan, start, stop, open_loop=key.stop is None)
            if stop is None:
                raise SamplerConfigError(f"tracer.iter[{key.start}::{stride}] needs a stop here: {self.plan.adaptive}, "
                                         "so the run's length is unknown before it runs.", argument="tracer.iter",
                                         value=key, allowed="a slice with a stop, or a stride of 1")
            return StepIterations(self.plan, steps=list(range(start, stop, stride)))
        if isinstance(key, (list, tuple, range)):
            return StepIterations(self.plan, steps=self._steps(key, key))
        if isinstance(key, torch.Tensor) or not isinstance(key, int):
            raise ArgumentTypeError(f"tracer.iter takes an int, a slice or a list of steps, got {key!r}.",
                                    argument="tracer.iter", value=key)
        step = self._step(key, "tracer.iter")
        return StepIterations(self.plan, step, step + 1)

    def _step(self, key: Any, name: str) -> int:
        """A step index: negatives count from the end, except on a run whose length is known only at its end
        (refused there, as `generate` refuses steps(-1))."""
        n, adaptive = self.plan.n_steps, self.plan.adaptive
        if adaptive is None:
            return validate.index(key, n, name=name, what="denoising step")
        key = validate.integer(key, name=name)
        if key < 0:
            raise SamplerConfigError(f"{name}={key}: step indices counted from the end are ambiguous here: {adaptive}, "
                                     "so the run's length is unknown. Use explicit step numbers.", argument=name,
                                     value=key, allowed="non-negative step indices")
        return validate.integer(key, name=name, max=None if n is None else n - 1, error=OutOfRangeError)

    def _stop(self, stop: Any, key: slice) -> int:
        n = self.plan.n_steps
        if self.plan.adaptive is None:
            stop = validate.integer(stop, name="tracer.iter stop", min=-n, max=n, error=OutOfRangeError)
            return stop + n if stop < 0 else stop
        if validate.integer(stop, name="tracer.iter stop") < 0:
            self._step(stop, "tracer.iter stop")  # refused: counted from the end
        return validate.integer(stop, name="tracer.iter stop", max=n, error=OutOfRangeError)

    def _steps(self, keys: Any, shown: Any) -> list[int]:
        out = [self._step(k, "tracer.iter") for k in keys]
        if out != sorted(set(out)):
            raise OutOfRangeError(f"tracer.iter[{shown!r}]: steps must increase (the run goes forward), got {out}.",
                                  argument="tracer.iter", value=shown)
        return out

    def _indices(self):
        # Every location's occurrence is the step running, so inside a step's body every request names that step:
        # nnsight would relax the pin after the first read and let the next request follow "the next occurrence",
        # which under a step clock is the *next step* (an out-of-order read silently returning step k+1's value).
        mediator = getcurrent().mediator()
        _clock_requests(mediator)
        previous = getattr(mediator, "mdm_step", None)
        try:
            for step in super()._indices():
                mediator.mdm_step = step
                yield step
        finally:
            mediator.mdm_step = previous

    def __iter__(self):
        mediator = getcurrent().mediator()
        previous = getattr(mediator, "mdm_open_loop", False)
        mediator.mdm_open_loop = self.open_loop
        try:
            yield from super().__iter__()
        finally:
            mediator.mdm_open_loop = previous

    def execute(self, code: Any) -> None:
        mediator = getcurrent().mediator()
        previous = getattr(mediator, "mdm_open_loop", False)
        mediator.mdm_open_loop = self.open_loop
        try:
            super().execute(code)
        finally:
            mediator.mdm_open_loop = previous
