"""`StepRunner`: installs, for each forward pass of a sampler, exactly the hooks that belong to
that step (user hooks, reducers, trajectory cache), inside TransformerLens' `hooks()` context, so
they are removed after every step even when one raises."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import Tensor

from mdm_lens.diffusion.state import DenoisingState
from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.reducers import Reducer
from mdm_lens.hooks.steps import ALL_STEPS, BoundHook, StepHook, Steps, steps
from mdm_lens.hooks.trajectory import TrajectoryCache


def _as_steps(hook_steps: Any) -> Steps:
    if hook_steps is None:
        return ALL_STEPS
    if isinstance(hook_steps, Steps):
        return hook_steps
    if isinstance(hook_steps, (int, str)) and not isinstance(hook_steps, bool):
        hook_steps = [hook_steps]
    if not isinstance(hook_steps, (list, tuple, range)):
        raise ArgumentTypeError(f"hook_steps={validate.describe(hook_steps)} must be None, a step, a list of steps "
                                "or steps(...).", argument="hook_steps", value=hook_steps,
                                allowed="None, int, 'first'/'last', a list of them, or steps(...)")
    return steps(*hook_steps)


class StepRunner:
    def __init__(self, model: Any, fwd_hooks: Sequence[Any] = (), hook_steps: Any = None,
                 record: Sequence[Reducer] = (), cache: Any = None):
        self.model = model
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

    def begin(self, batch: int, max_pos: int, n_steps: int) -> None:
        """Validate everything (names, steps, memory) before any compute."""
        self.default_steps.resolve(n_steps)
        for h in self.user_hooks:
            h.when.resolve(n_steps)
        for r in self.reducers:
            r.when.resolve(n_steps)
            r.begin(self.model, batch, max_pos, n_steps)
        if self.cache is not None:
            self.cache.when.resolve(n_steps)
            self.cache.begin(self.model, batch, max_pos, n_steps)

    def _hooks_for(self, state: DenoisingState) -> list[tuple[str, Callable]]:
        out: list[tuple[str, Callable]] = []
        for h in self.user_hooks:
            if h.when.matches(state.step, state.n_steps, state.block, state.phase):
                out.extend((n, h.fn) for n in h.name)
        if state.phase == "cond":
            for r in self.reducers:
                if r.active(state):
                    out.extend(r.hooks(self.model, state))
            if self.cache is not None and self.cache.active(state):
                out.extend(self.cache.hooks(self.model, state))
        return out

    def forward(self, state: DenoisingState, tokens: Tensor, **kwargs: Any) -> Tensor:
        """One hooked forward pass for `state`; returns position-aligned logits."""
        self.model.state = state
        try:
            with self.model.hooks(fwd_hooks=self._hooks_for(state)):
                return self.model(tokens, return_type="aligned", **kwargs)
        finally:
            self.model.state = None

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
