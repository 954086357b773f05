"""nnsight tracing of the denoising loop: `tracer.iter[k]` is denoising step k.

    lm = mdm_lens.nnsight.DiffusionLM(model)                       # model: a HookedMDM
    with lm.generate(prompt, steps=64, gen_length=64, block_length=32) as tracer:
        for step in tracer.iter[0:4]:
            pats.append(lm.blocks[3].attn.hook_pattern.output.save())   # the step's conditional forward
            conf.append(lm.sampler.confidence.save())                   # the sampler's state, per step
        for step in tracer.iter[10]:
            lm.blocks[5].hook_resid_post.output[:, anchors] = 0          # an intervention at step 10
            lm.blocks[5].hook_resid_post.phase("uncond").output[:, anchors] = 0   # ... and on the CFG pass
        out = lm.generator.output.save()                                # the GenerateOutput
    with lm.trace(tokens):                                              # one plain forward
        logits = lm.output.save()

nnsight counts *visits* of a location: occurrence k of a module is its k-th call. A diffusion sampler
calls the model more than once per step (classifier-free guidance adds an unconditional pass), and
an attention pattern is only materialised at the steps where something reads it, so counting visits
would not name steps. Here the interleaver runs a *step clock* instead: during a generation every
location's occurrence is the index of the denoising step running, module values are those of the
step's conditional forward, and the other forward of the step (phase "uncond") has its own locations,
reached with `envoy.phase("uncond")`. The sampler's state is served at `lm.sampler.*` once per step
(before the step: `canvas`, `masked`, `prompt`, `block`; after it: `confidence`, `committed`,
`state`); it is read-only — intervene on the model, as with mdm_lens' own step hooks.
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref

if __name__ == "nnsight":  # pragma: no cover - only when mdm_lens/ itself is on sys.path (a script run from it)
    # `import nnsight` found this file instead of the package; hand the importer the real package.
    import importlib
    import os

    _here, _path = os.path.dirname(os.path.abspath(__file__)), list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    try:
        del sys.modules["nnsight"]
        sys.modules["nnsight"] = importlib.import_module("nnsight")
    finally:
        sys.path[:] = _path
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

try:  # absolute import: this module's own name does not shadow the `nnsight` package
    from nnsight import NNsight
    from nnsight.intervention.envoy import Envoy, traceable
    from nnsight.intervention.eproperty import eproperty
    from nnsight.intervention.interleaver import Event, Interleaver, OutOfOrderError, dangling_unwind
    from nnsight.intervention.iterator import Iterations
    from nnsight.intervention.tracer import InterleavingTracer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("mdm_lens.nnsight needs nnsight >= 0.8: pip install 'mdm-lens[nnsight]'") from exc

from greenlet import getcurrent

from mdm_lens import validate
from mdm_lens.diffusion.generate import generate as mdm_generate
from mdm_lens.errors import ArgumentTypeError, InputError, MDMLensError, OutOfRangeError
from mdm_lens.model import HookedMDM

__all__ = ["DiffusionLM", "StepNotRunError", "PHASES"]

PHASES = ("cond", "uncond")
BEFORE = ("canvas", "masked", "prompt", "block")  # sampler values served before a step's forward
AFTER = ("confidence", "committed", "state")  # ... and after its commit
_FIELDS = {"canvas": "x"}  # sampler value -> DenoisingState field, where the names differ
_GENERATE_DEFAULTS = {k: p.default for k, p in inspect.signature(mdm_generate).parameters.items()
                      if p.default is not inspect.Parameter.empty}


class StepNotRunError(MDMLensError, OutOfOrderError):
    """A traced value was requested at a denoising step (or phase) the run never made."""


def _phase_location(location: str, phase: str) -> str:
    """`model.blocks.0.output` -> `model.blocks.0.@uncond.output`: the same value on another forward."""
    path, _, key = location.rpartition(".")
    return f"{path}.@{phase}.{key}"


@dataclass
class _Plan:
    """What a generation will do, known before it runs (for `tracer.iter` and `phase`)."""

    n_steps: int
    has_uncond: bool


@dataclass
class _Run:
    """The step clock of a generation in progress."""

    plan: _Plan
    step: int = 0
    phase: str = "cond"
    clocked: bool = True
    states: list = field(default_factory=list)  # the cond DenoisingState of every step started

    @property
    def n_run(self) -> int:
        return len(self.states)


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
        if run.states:
            self._serve(run.states[-1], AFTER)
        run.clocked = False  # what follows (generator output, tracer.result) counts plainly

    def _reset(self, step: int) -> None:
        """No location has been visited yet in `step`: each one's next occurrence is `step`."""
        self.keys.update(self.counts)
        self.counts = dict.fromkeys(self.keys, step)

    def _forward_starts(self) -> None:
        run, state = self.run, self.model_ref().state
        if state is None or state.phase == "cond":
            step = run.n_run if state is None else state.step
            if run.states and step == run.states[-1].step:
                raise MDMLensError(f"denoising step {step} ran a second conditional forward; the step clock "
                                   "serves one conditional forward per step (others need their own phase).")
            run.phase = "cond"
            if run.states:
                self._serve(run.states[-1], AFTER)
            run.states.append(state)
            run.step = step
            self._reset(step)
            self._serve(state, BEFORE)
        else:
            run.phase = state.phase

    def _serve(self, state: Any, names: tuple[str, ...]) -> None:
        for name in names:
            value = state if name == "state" else (None if state is None else getattr(state, _FIELDS.get(name, name)))
            self.handle(f"{self.sampler_path}.{name}", value)

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
            if mediator.pending.event is not Event.BARRIER and not (open_loop and run.n_run < run.plan.n_steps):
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
            why = (f"this run has {run.n_run} denoising steps (0..{run.n_run - 1})"
                   + ("" if run.n_run == run.plan.n_steps else f" of the {run.plan.n_steps} planned"))
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


class _ReadOnly:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, envoy: Any, value: Any) -> Any:
        raise InputError(f"lm.sampler.{self.name} is read-only: the sampler's state is observed, not edited; "
                         "intervene on the model instead (e.g. lm.blocks[l].hook_resid_post.output).")


def _sampler_value(name: str, doc: str) -> eproperty:
    def value(self: Any, v: Any) -> Any:
        return v

    value.__name__, value.__doc__ = name, doc
    prop = eproperty(description=doc)(value)
    return prop.postprocess(_ReadOnly(name))


class Sampler(nn.Module):
    """A placeholder module: the sampler's state is served by the interleaver, not computed here."""

    def forward(self, *args: Any) -> Any:
        return args[0] if args else None


class SamplerEnvoy(Envoy):
    """`lm.sampler`: the sampler's state at each denoising step (read-only)."""

    canvas = _sampler_value("canvas", "[batch, pos] the model input before this step (masks where undecided)")
    masked = _sampler_value("masked", "[batch, pos] positions still masked before this step")
    prompt = _sampler_value("prompt", "[batch, pos] prompt positions (pads included)")
    block = _sampler_value("block", "int: the semi-autoregressive block this step decodes")
    confidence = _sampler_value("confidence", "[batch, pos] the sampler's confidence (-inf where not a candidate)")
    committed = _sampler_value("committed", "[batch, pos] positions committed by this step")
    state = _sampler_value("state", "the step's DenoisingState, with its post-commit fields filled")


class Generator(nn.Module):
    """What the sampler's output is passed through, so it is served at `lm.generator.output`."""

    def forward(self, value: Any) -> Any:
        return value


class _PhaseView:
    """`envoy.phase("uncond")`: the same module's values on the step's unconditional forward."""

    input = Envoy.input
    inputs = Envoy.inputs
    output = Envoy.output

    def __init__(self, envoy: Envoy, phase: str):
        self.path = f"{envoy.path}.@{phase}"
        self.interleaver = envoy.interleaver

    def __repr__(self) -> str:
        return f"<phase view {self.path}>"


class _Phases:
    def phase(self, phase: str) -> Any:
        """This module on one forward of the step: "cond" (the default, the step's main forward) or
        "uncond" (LLaDA's classifier-free-guidance pass, run with the prompt masked)."""
        phase = validate.choice(phase, PHASES, name="phase", error=InputError)
        if phase == "cond":
            return self
        plan = self.interleaver.plan
        if plan is not None and not plan.has_uncond:
            raise InputError(f"phase={phase!r}: this run has no unconditional pass; LLaDA runs one per step "
                             "only with cfg_scale > 0.", argument="phase", value=phase)
        return _PhaseView(self, phase)


class PhasedEnvoy(_Phases, Envoy):
    """The envoy of every module of a `DiffusionLM`: nnsight's, plus `phase(...)`."""


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
            start = 0 if key.start is None else validate.index(key.start, n, name="tracer.iter start",
                                                               what="denoising step")
            stop = n if key.stop is None else validate.integer(key.stop, name="tracer.iter stop", min=-n, max=n,
                                                               error=OutOfRangeError)
            stop = stop + n if stop < 0 else stop
            stride = 1 if key.step is None else validate.integer(key.step, name="tracer.iter step", min=1)
            if stop <= start:
                raise OutOfRangeError(f"tracer.iter[{start}:{stop}] selects no step of this run's {n} steps.",
                                      argument="tracer.iter", value=key)
            if stride == 1:
                return StepIterations(self.plan, start, stop, open_loop=key.stop is None)
            return StepIterations(self.plan, steps=list(range(start, stop, stride)))
        if isinstance(key, (list, tuple, range)):
            return StepIterations(self.plan, steps=self._steps(key, key))
        if isinstance(key, torch.Tensor) or not isinstance(key, int):
            raise ArgumentTypeError(f"tracer.iter takes an int, a slice or a list of steps, got {key!r}.",
                                    argument="tracer.iter", value=key)
        step = validate.index(key, n, name="tracer.iter", what="denoising step")
        return StepIterations(self.plan, step, step + 1)

    def _steps(self, keys: Any, shown: Any) -> list[int]:
        out = [validate.index(k, self.plan.n_steps, name="tracer.iter", what="denoising step") for k in keys]
        if out != sorted(set(out)):
            raise OutOfRangeError(f"tracer.iter[{shown!r}]: steps must increase (the run goes forward), got {out}.",
                                  argument="tracer.iter", value=shown)
        return out

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


class DiffusionTracer(InterleavingTracer):
    """The tracer of `lm.generate(...)` / `lm.trace(...)`; its `iter` counts denoising steps."""

    def __init__(self, envoy: Any, fn: Any, *args: Any, **kwargs: Any):
        super().__init__(envoy, fn, *args, **kwargs)
        self.plan = envoy._plan(fn, kwargs)

    @property
    def iter(self) -> Iterations:
        if self.plan is None:  # a plain forward: nnsight's own occurrences
            return super().iter
        return StepIterations(self.plan)

    def execute(self, code: Any) -> None:
        interleaver = self.envoy.interleaver
        interleaver.plan = self.plan
        try:
            super().execute(code)
        finally:
            interleaver.plan = None


class DiffusionLM(_Phases, NNsight):
    """An nnsight model around a `HookedMDM` whose `generate` traces the real sampler step by step.

    Every module of the model is an envoy with TransformerLens names (`lm.blocks[3].attn.hook_pattern`,
    `lm.blocks[5].hook_resid_post`, `lm.embed`, ...); `lm.sampler` serves the sampler's state and
    `lm.generator.output` (or `tracer.result`) the `GenerateOutput`. `lm.generate(prompt, **kwargs)`
    takes `HookedMDM.generate`'s arguments (fwd_hooks, record and cache too, so both styles mix).
    """

    def __init__(self, model: HookedMDM):
        if not isinstance(model, HookedMDM):
            raise ArgumentTypeError(f"DiffusionLM wraps a HookedMDM, got {type(model).__name__}.",
                                    argument="model", value=type(model).__name__, allowed="HookedMDM")
        interleaver = StepInterleaver()
        super().__init__(model, interleaver=interleaver, envoys=PhasedEnvoy)
        interleaver.model_ref = weakref.ref(model)
        interleaver.root_input, interleaver.root_output = f"{self.path}.input", f"{self.path}.output"
        interleaver.sampler_path = f"{self.path}.sampler"
        object.__setattr__(self, "sampler", SamplerEnvoy(Sampler(), path=interleaver.sampler_path,
                                                         interleaver=interleaver, parent=self))
        object.__setattr__(self, "generator", Envoy(Generator(), path=f"{self.path}.generator",
                                                    interleaver=interleaver, parent=self))
        self._children.extend([self.sampler, self.generator])
        clocked = [e for e in self.modules() if e is not self.generator]
        interleaver.keys = {f"{e.path}.{k}" for e in clocked for k in ("input", "skip", "output")}
        interleaver.keys |= {_phase_location(k, p) for k in interleaver.keys for p in PHASES[1:]}
        interleaver.keys |= {f"{self.sampler.path}.{name}" for name in BEFORE + AFTER}
        for block in self.blocks:
            attn = block.attn
            locations = tuple(f"{hook.path}.{k}" for hook in (attn.hook_attn_scores, attn.hook_pattern)
                              for k in ("input", "skip", "output"))
            module = attn._module
            module.force_explicit = _AttentionGate(interleaver, locations, module.force_explicit)

    # --- running -------------------------------------------------------------------------------
    def trace(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("tracer_cls", DiffusionTracer)
        return super().trace(*args, **kwargs)

    @traceable
    def generate(self, prompt: Any = None, **kwargs: Any) -> Any:
        """Run `HookedMDM.generate` with the trace's interventions bound to denoising steps."""
        if prompt is None:
            raise InputError("lm.generate needs a prompt: text or token ids [batch, pos] (with attention_mask for "
                             "a left-padded batch).", argument="prompt", value=None)
        interleaver = self.interleaver
        plan = interleaver.plan or self._plan(self.generate, kwargs)
        interleaver.begin_run(plan)
        try:
            out = mdm_generate(self._module, prompt, **kwargs)
            interleaver.finish_run()
        finally:
            interleaver.run.clocked = False  # also when the sampler raised
        return self.generator(out, hook=True)

    def _plan(self, fn: Any, kwargs: dict) -> _Plan | None:
        if getattr(fn, "__name__", None) != "generate":
            return None
        settings = {"steps": None, "gen_length": 32, "sampler": "auto", "cfg_scale": 0.0, **_GENERATE_DEFAULTS,
                    **kwargs}
        steps = settings["steps"] if settings["steps"] is not None else settings["gen_length"]
        steps = validate.integer(steps, name="steps", min=1)
        sampler = settings["sampler"]
        llada = sampler == "llada" or (sampler == "auto" and self._module.cfg.attention != "causal"
                                       and not self._module.cfg.logit_shift)
        cfg_scale = settings["cfg_scale"]
        return _Plan(steps, bool(llada and isinstance(cfg_scale, (int, float)) and cfg_scale > 0))

    # --- batching: one input per trace (a batch is one [batch, pos] tensor) ----------------------
    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        prompt = inputs[0] if inputs else kwargs.get("prompt", kwargs.get("tokens"))
        if prompt is None:
            return 0
        if isinstance(prompt, str):
            return 1
        if isinstance(prompt, torch.Tensor):
            return 1 if prompt.ndim <= 1 else int(prompt.shape[0])
        return len(prompt) if isinstance(prompt, (list, tuple)) else 1

    def _batch(self, invokes: list, fn: Any) -> tuple:
        if len(invokes) > 1:
            raise InputError(f"{len(invokes)} tracer.invoke blocks: DiffusionLM runs one input per trace; batch "
                             "prompts as one left-padded [batch, pos] tensor with attention_mask.")
        return super()._batch(invokes, fn)
