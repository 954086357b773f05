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

import sys
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

from typing import Any

import torch
from torch import nn

try:  # absolute import: this module's own name does not shadow the `nnsight` package
    from nnsight import NNsight
    from nnsight.intervention.envoy import Envoy, traceable
    from nnsight.intervention.eproperty import eproperty
    from nnsight.intervention.tracer import InterleavingTracer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("mdm_lens.nnsight needs nnsight >= 0.8: pip install 'mdm-lens[nnsight]'") from exc

from mdm_lens import validate
from mdm_lens._nnsight_clock import (AFTER, BEFORE, PHASES, StepInterleaver, StepIterations, StepNotRunError,
                                     _AttentionGate, _phase_location, _Plan)
from mdm_lens.diffusion.generate import generate as mdm_generate
from mdm_lens.diffusion.generate import plan as plan_run
from mdm_lens.diffusion.registry import all_settings
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.model import HookedMDM

__all__ = ["DiffusionLM", "StepNotRunError", "PHASES"]



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

    def __getitem__(self, key: Any) -> Any:
        # nnsight resolves an int by attribute name, so an index past the end read "no attribute '9'"
        module = self._module
        if isinstance(module, nn.ModuleList) and not isinstance(key, slice):
            name = self.path.rsplit(".", 1)[-1] or "index"
            validate.index(key, len(module), name=name, what=f"entry of {name}")
        return super().__getitem__(key)


class DiffusionTracer(InterleavingTracer):
    """The tracer of `lm.generate(...)` / `lm.trace(...)`; its `iter` counts denoising steps."""

    def __init__(self, envoy: Any, fn: Any, *args: Any, **kwargs: Any):
        super().__init__(envoy, fn, *args, **kwargs)
        self.plan = envoy._plan(fn, kwargs)

    @property
    def iter(self) -> Any:
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
        from mdm_lens.ddit.model import HookedDDiT

        if not isinstance(model, (HookedMDM, HookedDDiT)):
            raise ArgumentTypeError(f"DiffusionLM wraps a HookedMDM or a HookedDDiT, got {type(model).__name__}.",
                                    argument="model", value=type(model).__name__, allowed="HookedMDM, HookedDDiT")
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
        # the sampler's own resolution, checked as generate checks it (the tracer's own keywords, e.g. backend=,
        # are not sampler settings; a misspelt setting is refused by generate itself)
        known = all_settings() | {"sampler"}
        planned = plan_run(self._module, **{k: v for k, v in kwargs.items() if k in known})
        if planned is None:  # DreamOn, DiffusionGemma: no plan before the run
            return _Plan(None, False, "this sampler decides its number of forwards as it runs")
        return _Plan(planned.n_steps, "uncond" in planned.phases, planned.adaptive)

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
