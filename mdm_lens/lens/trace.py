"""`lens_trace`: a lens (logit, or tuned) over every step × layer × answer position of one trajectory, reduced as
it goes. Above `logit` (the read-out) and `tuned` (the translators), so the two never import each other."""

from __future__ import annotations

import contextlib

from typing import Any, Callable

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.noisy import noisy_positions
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.lens.logit import SOURCES, LensTrace, check_model, reduce_layer, resid_name
from mdm_lens.lens.tuned import TunedLens
from mdm_lens.diffusion.own_forwards import OWN_FORWARDS
from mdm_lens.diffusion.replay import replay_rows
from mdm_lens.lens.run_only import _at_positions, run_only_trace

# samplers over a masked canvas; mdlm / duo / gidd: "masked" positions are mdm_lens.noisy's (Duo: every generated
# position, still resampleable noise; GIDD: [MASK] and, with p_uniform > 0, every generated position). nemotron and
# bd3lm forward windows against a KV cache: the lens reads their run's own cache (RUN_ONLY)
LENS_SAMPLERS = ("llada", "dream", "llada2", "sdar", "rnd1", "coda", "mdlm", "duo", "gidd", "nemotron", "bd3lm")
# read from the run's own cache only (own_forwards; `out.replay` rebuilds these steps too, diffusion.window_replay, but the lens reads what the run computed): steps that are no denoising
# forward (nemotron's prefill / commit, bd3lm's storing forward) or ran no forward are NaN with the reason
RUN_ONLY = tuple(OWN_FORWARDS)
CACHE_HOW = "generate with cache='blocks.*.hook_resid_post' (HookedDDiT with time conditioning: also 'hook_sigma')"


def lens_refusal(out: Any) -> str | None:
    """Why a lens over this run's denoising steps cannot be read (None when it can): a causal run has no masked
    canvas; a sampler whose steps a replay cannot rebuild (`Sampler.no_replay`) gives no step residuals."""
    from mdm_lens.diffusion.registry import get, names

    if out.causal:
        return "causal (ARM) model: no masked canvas to read a lens over"
    sampler = get(out.sampler) if out.sampler in names() else None
    if out.sampler in RUN_ONLY:
        c = out.cache
        resid = c is not None and any(n.endswith("hook_resid_post") for n in getattr(c, "names", ()))
        if not resid or "cond" not in getattr(c, "phases", ()):
            return (f"a {out.sampler!r} run is read from its own forwards : {CACHE_HOW}, "
                    "every step")
        return None
    if sampler is not None and sampler.no_replay and out.sampler not in LENS_SAMPLERS:
        return f"a {out.sampler!r} run cannot be replayed step by step: {sampler.no_replay}"
    if out.sampler not in LENS_SAMPLERS:
        return (f"the lens over denoising steps reads diffusion runs (sampler one of {LENS_SAMPLERS}); "
                f"{out.sampler!r} is not one")
    return None


def _check_run(model: Any, out: Any) -> None:
    from mdm_lens.diffusion.output import require_output

    require_output(out)
    from mdm_lens.diffusion.fixed_length import require_fixed_length

    require_fixed_length(out, "lens_trace", "the lens reads answer position p at every step, and a row inserted or "
                         "deleted before p puts another token (or none) in that column at earlier steps")
    why = lens_refusal(out)
    if why is not None:
        raise InputError(f"out is a {out.sampler!r} run; {why}.", argument="out", value=out.sampler,
                         allowed=f"a run of {LENS_SAMPLERS}")
    out.check_model(model)
    # window forwards: neither a replay nor the cache rows cover them (RUN_ONLY runs read exactly those rows)
    if out.settings.get("kv_cache") is not None and out.sampler not in RUN_ONLY:
        raise InputError(f"out is a kv_cache={out.settings['kv_cache']!r} run: its window forwards attended to stale "
                         "keys/values and computed a window of rows, so a lens over replayed (fresh) forwards would "
                         "not be what the sampler read. Lens a run without kv_cache, or see probes.cache_effect.",
                         argument="out", value=out.settings["kv_cache"], allowed="a run without kv_cache")
    if out.settings.get("mask_id") != model.cfg.mask_token_id:
        raise InputError(f"out was not made by this model ({model.cfg.model_name!r}): its mask id differs.",
                         argument="out", value=out.model_name, allowed="a run of the same model")


def _cached(out: Any, layers: list[int], steps: list[int]) -> bool:
    c = out.cache
    if c is None or not hasattr(c, "names") or "cond" not in getattr(c, "phases", ()):
        return False
    return all(resid_name(l) in c.names for l in layers) and set(steps) <= set(c.steps)


def lens_trace(model: Any, out: Any, *, layers: Any = None, steps: Any = None, positions: Any = None,
               lens: Any = None, source: str = "auto") -> LensTrace:
    """The (logit or tuned) lens at every chosen step, layer and answer position of one run.

    Args:
        model: the HookedMDM that made `out`.
        out: `model.generate(...)`'s output (a LLaDA or Dream run).
        layers: layer indices (None: all; negative count from the end).
        steps: step indices of the run (None: all).
        positions: answer positions, indices into the generated canvas (None: all).
        lens: a `TunedLens` (None: the logit lens).
        source: "cache" (read `out.cache`'s `blocks.{l}.hook_resid_post`), "replay" (re-run each step's forward)
            or "auto" (the cache when it has every requested step and layer, else replay).
    """
    check_model(model)
    _check_run(model, out)
    n, S = model.cfg.n_layers, out.n_steps
    gen = out.tokens.shape[1] - out.prompt_length
    layers = validate.indices(layers, n, name="layers", what="layer")
    steps = sorted(validate.indices(steps, S, name="steps", what=f"step of this {S}-step run"))
    positions = validate.indices(positions, gen, name="positions", what=f"answer position of {gen}")
    source = validate.choice(source, SOURCES, name="source")
    if lens is not None:
        if not isinstance(lens, TunedLens):
            raise ArgumentTypeError(f"lens={validate.describe(lens)} is not a TunedLens.", argument="lens",
                                    value=lens, allowed="None (logit lens) or a TunedLens")
        lens.check_model(model)
        for l in layers:
            lens.check_layer(l)
    if out.sampler in RUN_ONLY:
        return run_only_trace(model, out, layers, steps, positions, lens, source, CACHE_HOW)
    if source == "auto":
        source = "cache" if _cached(out, layers, steps) else "replay"
    elif source == "cache" and not _cached(out, layers, steps):
        raise InputError("source='cache' but out.cache lacks some of the requested steps/layers: generate with "
                         "cache='blocks.*.hook_resid_post' @ steps(...) covering them, or use source='replay'.",
                         argument="source", value=source, allowed="'replay' or 'auto'")
    absolute = torch.tensor([out.prompt_length + p for p in positions])
    src = absolute - 1 if model.cfg.logit_shift else absolute  # canvas positions are >= 1, so i-1 exists
    target = out.tokens[:, absolute].cpu()
    per_step = []
    for s in steps:
        cells: dict[int, tuple] = {}
        reduce = lambda resid, l: cells.__setitem__(l, reduce_layer(model, resid, l, lens, src, target))  # noqa: E731
        if source == "cache":
            act, rows = out.cache[s], out.cache.rows_of(s)
            width = max(out.trajectory.x_steps.shape[-1], rows.stop)
            # a readout conditioned on the step (HookedDDiT's final adaLN reads σ of step s) runs in its state
            ctx = out.at_step(model, s) if callable(getattr(model, "readout", None)) else contextlib.nullcontext()
            with torch.no_grad(), ctx:  # a cached block's rows start at its block: placed at their positions
                for l in layers:
                    reduce(_at_positions(act[resid_name(l)].to(model.input_device), rows.start, width), l)
        else:
            _replay_step(model, out, s, layers, reduce)
        per_step.append([cells[l] for l in layers])
    stack = lambda k: torch.stack([torch.stack([c[k] for c in row]) for row in per_step])  # noqa: E731
    x = out.trajectory.x_steps[steps][:, :, absolute]
    top1_prob = stack(1)
    undefined = torch.isnan(top1_prob)  # a position the forward did not compute (SDAR's other blocks): no reading
    return LensTrace("logit" if lens is None else "tuned", steps, layers, positions, S, out.prompt_length,
                     stack(0).masked_fill(undefined, -1), top1_prob, stack(2), stack(3).masked_fill(undefined, -1),
                     target, out.trajectory.commit_step[:, absolute].clone(),
                     noisy_positions(model.cfg, x, out.prompt_length), source,
                     {"model": model.cfg.model_name, "sampler": out.sampler})


def _replay_step(model: Any, out: Any, step: int, layers: list[int], reduce: Callable[[Tensor, int], None]) -> None:
    """Re-run step `step`'s forward; each chosen layer is reduced inside its hook (nothing else is kept). A block
    sampler's forward covers the canvas up to its block's end: positions past it (later blocks, not in that
    forward) get NaN."""
    width = out.trajectory.x_steps.shape[-1]
    start = replay_rows(out, step).start  # the replay's first row (0: every replay forwards a prefix)

    def hook_for(layer: int) -> Callable:
        def fn(resid: Tensor, hook: Any) -> None:
            reduce(_at_positions(resid.detach(), start, max(width, start + resid.shape[1])), layer)
        return fn

    out.replay(model, step, fwd_hooks=[(resid_name(l), hook_for(l)) for l in layers])
