"""`StepRunner`: installs, for each forward pass of a sampler, exactly the hooks that belong to
that step (user hooks, reducers, trajectory cache), inside TransformerLens' `hooks()` context, so
they are removed after every step even when one raises."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from mdm_lens.diffusion.state import DenoisingState
from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError, NonFiniteError, SamplerConfigError
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.reducers import Reducer
from mdm_lens.hooks.steps import BoundHook, StepHook, Steps, as_steps
from mdm_lens.hooks.trajectory import TrajectoryCache


_as_steps = as_steps  # the former private name


class StepsNotReachedWarning(UserWarning):
    """A run whose length is known only at its end stopped before steps that were asked for."""


class StepRunner:
    def __init__(self, model: Any, fwd_hooks: Sequence[Any] = (), hook_steps: Any = None,
                 record: Sequence[Reducer] = (), cache: Any = None):
        self.model = model
        self.unknown_length: str | None = None  # why the run's length is known only at its end (None: fixed)
        default = self.default_steps = _as_steps(hook_steps)
        self.user_hooks: list[StepHook] = []
        for h in fwd_hooks:
            if isinstance(h, StepHook):
                self.user_hooks.append(h)
            elif isinstance(h, tuple) and len(h) == 2 and callable(h[1]):
                name, fn = h
                when = fn.when if isinstance(fn, BoundHook) else default
                fn = fn.fn if isinstance(fn, BoundHook) else fn
                self.user_hooks.append(StepHook(name, fn, when))
            else:
                raise ArgumentTypeError(f"fwd_hooks entries must be (name, fn) pairs or at_steps(...) hooks, got "
                                        f"{validate.describe(h)}.", argument="fwd_hooks", value=h,
                                        allowed="(name, callable) or StepHook")
        for h in self.user_hooks:
            h.name = expand_names(model, h.name)
        # a lone reducer is refused (record=[ReceivedAttention()]); full activations go in cache=
        self.reducers = validate.instances(list(record) if isinstance(record, tuple) else record, Reducer,
                                           name="record")
        names = [r.name for r in self.reducers]
        if len(set(names)) != len(names):
            raise InputError(f"two reducers share a record name ({names}); give one a name=.")
        self.cache = None if cache is None else TrajectoryCache.from_request(cache)

    def begin(self, batch: int, max_pos: int, n_steps: int, *, n_blocks: int | None = None,
              phases: Sequence[str] | None = None) -> None:
        """Validate everything (names, steps, blocks, phases, memory) before any compute.

        `n_blocks` and `phases` (the forward passes the sampler will run, e.g. ("cond", "uncond") for LLaDA with
        CFG) are given by the samplers; None where not known (a replay), so that selection is not checked. A
        selection that can never fire (a block the run does not have, a phase it never runs) is an error, not
        an empty record."""
        # hooks are checked as records and caches are: a hook bound only to phases the run never has would
        # silently never fire (one listing several phases passes when one of them runs)
        self.default_steps.check(n_steps, n_blocks, phases, what="hook_steps")
        for h in self.user_hooks:
            h.when.check(n_steps, n_blocks, phases, what=f"the hook on {h.name[0]}")
        for r in self.reducers:
            r.when.check(n_steps, n_blocks, phases, what=f"record {r.name!r}")
            r.begin(self.model, batch, max_pos, n_steps)
        if self.cache is not None:
            self.cache.when.check(n_steps, n_blocks, phases, what="cache")
            self.cache.begin(self.model, batch, max_pos, n_steps)

    def refuse_end_relative(self, why: str) -> None:
        """For runs whose length is known only at their end (adaptive stopping, confidence-driven commits):
        a step selector counted from the end ('last', -1) cannot be resolved before the run, so it is refused, and
        the states it runs say so (`DenoisingState.is_last` raises rather than answer False at the last step)."""
        self.unknown_length = why or "the sampler decides its number of forwards as it runs"
        specs = [self.default_steps] + [h.when for h in self.user_hooks] + [r.when for r in self.reducers]
        if self.cache is not None:
            specs.append(self.cache.when)
        if any(s == "last" or (isinstance(s, int) and s < 0) for w in specs for s in w.indices):
            raise SamplerConfigError(f"step indices counted from the end ('last', -1, …) are ambiguous here: {self.unknown_length}, "
                                     "so the run's length is unknown. Use explicit step numbers or steps(every=k).",
                                     argument="steps", value=[w.indices for w in specs if w.indices],
                                     allowed="non-negative step indices")

    def warn_unreached(self, n_run: int) -> None:
        """After a run of unknown length: the explicitly asked steps it never reached (nothing was recorded or
        hooked there) are named in a warning, so an empty cache row is never mistaken for a result."""
        specs = [("fwd_hooks", h.when) for h in self.user_hooks] + [(f"record {r.name!r}", r.when)
                                                                    for r in self.reducers]
        if self.cache is not None:
            specs.append(("cache", self.cache.when))
        for what, when in specs:
            late = sorted(s for s in when.indices if isinstance(s, int) and s >= n_run)
            if late:
                warnings.warn(f"{what}: steps {late} were asked for, but the run stopped after {n_run} forward(s); "
                              "nothing was recorded or hooked there.", StepsNotReachedWarning, stacklevel=5)

    def _hooks_for(self, state: DenoisingState) -> list[tuple[str, Callable]]:
        out: list[tuple[str, Callable]] = []
        for h in self.user_hooks:
            if h.when.matches(state.step, state.n_steps, state.block, state.phase):
                out.extend((n, h.fn) for n in h.name)
        if state.phase == "cond":  # reducers summarise the step's main forward (checked in Reducer.begin)
            for r in self.reducers:
                if r.active(state):
                    out.extend(r.hooks(self.model, state))
        if self.cache is not None and self.cache.active(state):
            out.extend(self.cache.hooks(self.model, state))
        return out

    def forward(self, state: DenoisingState, tokens: Tensor, **kwargs: Any) -> Tensor:
        """One hooked forward pass for `state`; returns position-aligned logits, checked finite (see
        `check_logits`) so that a hook that breaks the model stops the run at that step."""
        if self.unknown_length:
            state.extra.setdefault("unknown_length", self.unknown_length)
        self.model.state = state
        self.last_state = state  # a sampler that commits after its forward reads it back for end_step
        hooks = self._hooks_for(state)
        try:
            with self.model.hooks(fwd_hooks=hooks):
                logits = self.model(tokens, return_type="aligned", **kwargs)
        finally:
            self.model.state = None
        check_logits(logits, state, [name for name, _ in hooks if any(name in h.name for h in self.user_hooks)])
        return logits

    def end_step(self, state: DenoisingState) -> None:
        for r in self.reducers:
            if r.active(state):
                r.end_step(state)

    def records(self) -> tuple[dict[str, Tensor], dict[str, dict]]:
        records, meta = {}, {}
        for r in self.reducers:
            for key, value in r.results().items():
                records[key] = value
                meta[key] = r.meta
        return records, meta


def check_logits(logits: Tensor, state: DenoisingState, hooked: Sequence[str] = ()) -> None:
    """NaN or +inf in the logits a sampler reads (the non-pad rows), or a row with no finite logit, raises
    `NonFiniteError` naming the step: a sampler would otherwise turn them into plausible tokens (argmax of NaN
    is 0). -inf entries are allowed (banning a token is a legitimate edit). One `isfinite` pass when all is well."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        return
    # one reduction, no [batch, pos, vocab] mask: NaN / ±inf make the sum non-finite (so can an overflow of finite
    # values, which the exact pass below then clears)
    total = logits.sum(dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(total)):
        return
    ok = torch.isfinite(logits)
    rows = state.key_visible
    if rows is not None and tuple(rows.shape) == tuple(logits.shape[:-1]):
        logits, ok = logits[rows.to(logits.device)], ok[rows.to(logits.device)]
    n_nan = int(torch.isnan(logits).sum())
    n_pos = int(torch.isposinf(logits).sum())
    dead = int((~ok.any(-1)).sum())
    if not (n_nan or n_pos or dead):
        return
    cause = (f"hooks at this step: {sorted(set(hooked))}" if hooked else
             "no user hook ran at this step: check the weights and dtype")
    raise NonFiniteError(
        f"denoising step {state.step} (phase {state.phase!r}): the logits the sampler reads hold {n_nan} NaN, "
        f"{n_pos} +inf and {dead} row(s) without a finite logit; the run stops here instead of sampling tokens "
        f"from them ({cause}).", argument="fwd_hooks", value=state.step, allowed="hooks that keep logits finite")
