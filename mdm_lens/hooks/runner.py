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
        self.user_hooks: list[StepHook] = [_entry(h, default) for h in fwd_hooks]
        self._hook_steps = (list(fwd_hooks), hook_steps)  # checked in `begin`, after the steps' own range
        for h in self.user_hooks:
            h.name = expand_names(model, h.name)
        # a lone reducer is refused (record=[ReceivedAttention()]); full activations go in cache=
        self.reducers = validate.instances(list(record) if isinstance(record, tuple) else record, Reducer,
                                           name="record")
        names = [r.name for r in self.reducers]
        if len(set(names)) != len(names):
            raise InputError(f"two reducers share a record name ({names}); give one a name=.")
        writes: dict[str, str] = {}  # record key -> the reducer writing it (KeyValueNorms / TopKKeys: fixed keys)
        for r in self.reducers:
            for key in getattr(r, "record_keys", (r.name,)):
                if key in writes:
                    raise InputError(f"{writes[key]} and {type(r).__name__}(name={r.name!r}) both write the record "
                                     f"{key!r}: one would silently replace the other; give the first another name= "
                                     "(KeyValueNorms and TopKKeys write fixed keys: one of each per run).",
                                     argument="record", value=key, allowed="reducers writing distinct record keys")
                writes[key] = f"{type(r).__name__}(name={r.name!r})"
        self.cache = None if cache is None else TrajectoryCache.from_request(cache)
        self.origins: dict[int, Tensor] = {}  # variable-length runs: step → original position of each row
        # block selections fire only where the run puts a step in that block (known while it runs): the forwards
        # each selection matched and each step's block, for the after-run warning on a selection that fired nowhere
        self.fired: dict[int, int] = {}
        self.block_of: dict[int, int] = {}
        self.skipped: dict[str, list[int]] = {}  # hook / cache → steps it names that ran no forward

    def begin(self, batch: int, max_pos: int, n_steps: int, *, n_blocks: int | None = None,
              phases: Sequence[str] | None = None) -> None:
        """Validate everything (names, steps, blocks, phases, memory) before any compute.

        `n_blocks` and `phases` (the forward passes the sampler will run, e.g. ("cond", "uncond") for LLaDA with
        CFG) are given by the samplers; None where not known (a replay), so that selection is not checked. A
        selection that can never fire (a block the run does not have, a phase it never runs) is an error, not
        an empty record."""
        # hooks are checked as records and caches are: a hook bound only to phases the run never has would
        # silently never fire (one listing several phases passes when one of them runs)
        self.n_steps = n_steps
        self.default_steps.check(n_steps, n_blocks, phases, what="hook_steps", unknown=self.unknown_length)
        if self._hook_steps[1] is not None:
            _check_hook_steps(*self._hook_steps)
        for h in self.user_hooks:
            h.when.check(n_steps, n_blocks, phases, what=f"the hook on {h.name[0]}", unknown=self.unknown_length)
        for r in self.reducers:
            r.when.check(n_steps, n_blocks, phases, what=f"record {r.name!r}", unknown=self.unknown_length)
            r.begin(self.model, batch, max_pos, n_steps)
        if self.cache is not None:
            self.cache.when.check(n_steps, n_blocks, phases, what="cache", unknown=self.unknown_length)
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
            # every= adds the last step on a run of known length; here the last forward was known only at the end
            if self.unknown_length and when.every is not None and n_run and (n_run - 1) % when.every and (
                    not when.indices or n_run - 1 in when.indices):
                warnings.warn(f"{what}: steps(every={when.every}) includes a run's last step when its length is "
                              f"known in advance; this run's length was decided as it ran, so its last forward "
                              f"(step {n_run - 1}) was not hooked or recorded.", StepsNotReachedWarning, stacklevel=5)

    def _hooks_for(self, state: DenoisingState) -> list[tuple[str, Callable]]:
        out: list[tuple[str, Callable]] = []
        self.block_of.setdefault(state.step, state.block)
        for h in self.user_hooks:
            if h.when.matches(state.step, state.n_steps, state.block, state.phase):
                self._fire(h.when)
                out.extend((n, h.fn) for n in h.name)
        if state.phase == "cond":  # reducers summarise the step's main forward (checked in Reducer.begin)
            for r in self.reducers:
                if r.active(state):
                    self._fire(r.when)
                    out.extend(r.hooks(self.model, state))
        if self.cache is not None and self.cache.active(state):
            self._fire(self.cache.when)
            out.extend(self.cache.hooks(self.model, state))
        return out

    def _fire(self, when: Any) -> None:
        self.fired[id(when)] = self.fired.get(id(when), 0) + 1

    def warn_unfired_blocks(self) -> None:
        """After a run: a selection with `blocks=` that matched no forward (e.g. `steps(0, blocks=[1])`, whose step
        0 lies in block 0) is named in a warning with the steps each block ran, since which step falls in which
        block is known only as the sampler runs and an empty record must not pass for a result."""
        if not self.block_of:
            return
        specs = [("fwd_hooks", h.when) for h in self.user_hooks] + [(f"record {r.name!r}", r.when)
                                                                    for r in self.reducers]
        if self.cache is not None:
            specs.append(("cache", self.cache.when))
        runs: dict[int, list[int]] = {}
        for step, block in sorted(self.block_of.items()):
            runs.setdefault(block, []).append(step)
        for what, when in specs:
            if when.blocks is not None and not self.fired.get(id(when)):
                shown = {b: runs.get(b, []) for b in when.blocks}
                warnings.warn(f"{what}: its selection (steps {list(when.indices) or 'any'}, every={when.every}, "
                              f"blocks={list(when.blocks)}) matched no forward of this run: the steps of those "
                              f"blocks were {shown}; nothing was recorded or hooked.", StepsNotReachedWarning,
                              stacklevel=5)

    def forward(self, state: DenoisingState, tokens: Tensor, **kwargs: Any) -> Tensor:
        """One hooked forward pass for `state`; returns position-aligned logits, checked finite (see
        `check_logits`) so that a hook that breaks the model stops the run at that step."""
        if self.unknown_length:
            state.extra.setdefault("unknown_length", self.unknown_length)
        self.model.state = state
        self.last_state = state  # a sampler that commits after its forward reads it back for end_step
        hooks = self._hooks_for(state)
        # the exact call, for hooks that must re-run this very forward unhooked first (knockout's anchor pre-pass):
        # same tokens, kwargs and attached KV cache; removed after the forward so no state keeps it
        state.extra["forward_call"] = lambda: rerun(self.model, tokens, kwargs)
        try:
            with self.model.hooks(fwd_hooks=hooks):
                logits = self.model(tokens, return_type="aligned", **kwargs)
        finally:
            self.model.state = None
            state.extra.pop("forward_call", None)
        check_logits(logits, state, [name for name, _ in hooks if any(name in h.name for h in self.user_hooks)])
        return logits

    def end_step(self, state: DenoisingState) -> None:
        if state.variable_length:
            self.origins[state.step] = state.origin.detach().cpu()
        for r in self.reducers:
            if r.active(state):
                r.end_step(state)

    def no_forward(self, step: int, block: int = 0) -> None:
        """Step `step` ran no forward (an MDLM `ddpm_cache` / BD3LM step that sampled again from an earlier step's
        p(x0), the canvas unchanged): a reducer scheduled there records no row, and its meta lists the step under
        "no_forward" so that readers say why the row is missing rather than that the reducer was not passed."""
        n = getattr(self, "n_steps", step + 1)
        for r in self.reducers:
            if r.when.matches(step, n, block, "cond"):
                r.no_forward.append(step)
        # a hook or cache that names this step explicitly has nothing to act on: said after the run (as for an
        # unreached block), so an empty cache row or an unfired edit is never taken for a result
        named = [(f"the hook on {h.name[0]}", h.when) for h in self.user_hooks]
        named += [("cache", self.cache.when)] if self.cache is not None else []
        for what, when in named:
            if when.indices and when.matches(step, n, block, "cond"):
                self.skipped.setdefault(what, []).append(step)

    def records(self) -> tuple[dict[str, Tensor], dict[str, dict]]:
        """The reducers' records and meta, read once a run has ended (every sampler calls it last): also where a
        block selection that fired nowhere is warned about."""
        self.warn_unfired_blocks()
        for what, skipped in self.skipped.items():
            warnings.warn(f"{what}: steps {skipped} ran no forward (they reused an earlier step's p(x0), the canvas "
                          "unchanged), so nothing was hooked or cached there.", StepsNotReachedWarning, stacklevel=5)
        records, meta = {}, {}
        for r in self.reducers:
            for key, value in r.results().items():
                records[key] = value
                # a reducer whose records differ in layout (kv_norms' kv_age is [step, pos]) names them per record
                own = r.meta.get("record_axes", {})
                meta[key] = {k: v for k, v in r.meta.items() if k != "record_axes"}
                if key in own:
                    meta[key]["axes"] = own[key]
                if self.origins:  # column k of a variable-length step is no fixed position: say which it is
                    meta[key] = dict(meta[key], origin=self._origin_rows(r.steps_seen, int(r.max_pos)))
        return records, meta

    def _origin_rows(self, steps: Sequence[int], width: int) -> Tensor:
        """`[step, batch, pos]` original position of each record column (−1: inserted; −2: beyond that step's
        canvas, where the records hold padding)."""
        rows = []
        for s in steps:
            o = self.origins[s]
            rows.append(torch.cat([o, o.new_full((o.shape[0], width - o.shape[1]), -2)], dim=1))
        return torch.stack(rows)


def rerun(model: Any, tokens: Tensor, kwargs: dict) -> None:
    """Run the forward `model(tokens, **kwargs)` again as it is being run, leaving any attached KV cache as that
    forward leaves it: a cache-filling forward ("fill", "dual") rewrites what the forward itself then overwrites,
    and an "append" forward (SDAR's finished blocks) runs as "block" (the same keys read, nothing kept), so the
    cache is not extended twice."""
    layers = [getattr(getattr(b, "attn", None), "kv", None) for b in model.blocks]
    appending = [kv for kv in layers if kv is not None and getattr(kv, "mode", None) == "append"]
    for kv in appending:
        kv.mode = "block"
    try:
        model(tokens, return_type=None, **kwargs)
    finally:
        for kv in appending:
            kv.mode = "append"


def _entry(h: Any, default: Steps) -> StepHook:
    """One `fwd_hooks` entry as a StepHook: a plain pair follows `hook_steps`, an at_steps hook its own steps."""
    if isinstance(h, StepHook):
        return h
    if isinstance(h, tuple) and len(h) == 2 and isinstance(h[1], StepHook):
        # a named at_steps hook inside a pair: two names for one hook; say which to drop rather than guess
        inner = h[1].name
        same = "the same name twice" if inner == h[0] else f"two names that disagree ({h[0]!r} and {inner!r})"
        raise ArgumentTypeError(
            f"fwd_hooks entry ({h[0]!r}, at_steps(..., name={inner!r})) gives {same}: an at_steps hook made with "
            f"name= goes in the list on its own (fwd_hooks=[at_steps(fn, ..., name={inner!r})]); to pair it with a "
            f"name, build it without name= (fwd_hooks=[({h[0]!r}, at_steps(fn, ...))]).", argument="fwd_hooks",
            value=h, allowed="(name, fn), (name, at_steps(fn, steps)) or at_steps(fn, steps, name=...)")
    if isinstance(h, tuple) and len(h) == 2 and callable(h[1]):
        name, fn = h
        if isinstance(fn, BoundHook):
            return StepHook(name, fn.fn, fn.when)
        return StepHook(name, fn, default)
    if isinstance(h, BoundHook):  # at_steps(fn, steps) without name=: a function still to be paired with its hook
        raise ArgumentTypeError("fwd_hooks entry at_steps(fn, steps) has no hook name: build it with name= "
                                "(at_steps(fn, steps, name='blocks.0.attn.hook_z')) or pair it with one "
                                "(('blocks.0.attn.hook_z', at_steps(fn, steps))).", argument="fwd_hooks", value=h,
                                allowed="(name, fn), (name, at_steps(fn, steps)) or at_steps(fn, steps, name=...)")
    raise ArgumentTypeError(f"fwd_hooks entries must be (name, fn) pairs or at_steps(...) hooks, got "
                            f"{validate.describe(h)}.", argument="fwd_hooks", value=h,
                            allowed="(name, callable) or StepHook")


def _check_hook_steps(fwd_hooks: Sequence[Any], hook_steps: Any) -> None:
    """`hook_steps` applies to plain `(name, fn)` pairs only (an at_steps hook keeps its own steps, as documented
    in `generate`). With no plain pair it would do nothing: refused, saying which selector the hooks follow,
    rather than silently dropped."""
    bound = [h for h in fwd_hooks if isinstance(h, StepHook) or isinstance(h[1], BoundHook)]
    if len(bound) == len(fwd_hooks) and bound:
        raise SamplerConfigError(
            f"hook_steps={validate.describe(hook_steps)} applies to plain (name, fn) pairs, but every hook in fwd_hooks "
            f"is an at_steps(...) hook ({len(bound)}), which fires at its own steps only: hook_steps would be ignored. "
            "Give the steps once: at_steps(fn, [...]) per hook, or plain (name, fn) pairs with hook_steps.",
            argument="hook_steps", value=hook_steps, allowed="None when fwd_hooks holds only at_steps(...) hooks")
    if not fwd_hooks:
        raise SamplerConfigError(
            f"hook_steps={validate.describe(hook_steps)} selects the steps of plain fwd_hooks, but fwd_hooks is empty, "
            "so it would do nothing. Pass fwd_hooks=[(name, fn)], or choose steps where they belong: "
            "cache='name' @ steps(...) for a trajectory cache, ReducerClass(when=steps(...)) in record=.",
            argument="fwd_hooks", value=list(fwd_hooks), allowed="at least one (name, fn) pair when hook_steps is given")


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
