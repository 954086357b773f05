"""The lens over the steps of a run whose forwards are windows against a KV cache (nemotron, bd3lm: `own_forwards`), read from
the residuals the run's own forwards computed (`out.cache`), each row at its absolute position.

A run step that is no denoising forward (nemotron's causal prefill / commit, bd3lm's storing forward) or that ran
no forward (bd3lm reusing p(x0) after a step that changed nothing) is NaN at every position; a position outside
the rows a denoising forward computed (another block) is NaN too. NaN cells have `top1` and `final_rank` −1 (the
integer stand-in) and `top1_prob` / `final_prob` NaN; `meta["step_notes"]` says why per step.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch
from torch import Tensor

from mdm_lens.diffusion.own_forwards import step_notes
from mdm_lens.errors import InputError
from mdm_lens.lens.logit import LensTrace, reduce_layer, resid_name
from mdm_lens.noisy import noisy_positions

NOT_COMPUTED = ("a position outside the rows a denoising forward computed (another block, or a step that is no "
                "denoising forward) is NaN: top1 / final_rank -1, top1_prob / final_prob NaN")


def _at_positions(resid: Tensor, start: int, width: int) -> Tensor:
    """`[batch, width, d]` with the rows of `resid` at positions `[start, start + rows)` and NaN elsewhere (a
    position the forward did not compute: earlier / later blocks, positions past a block run's forward)."""
    if start == 0 and resid.shape[1] == width:
        return resid
    out = resid.new_full((resid.shape[0], width, resid.shape[2]), float("nan"))
    out[:, start:start + resid.shape[1]] = resid
    return out


def _needs_sigma(model: Any) -> bool:
    return callable(getattr(model, "readout", None)) and bool(model.cfg.extra.get("time_conditioning", False))


def _check_cache(model: Any, out: Any, layers: list[int], source: str, how: str) -> None:
    if source == "replay":
        raise InputError(f"source='replay': a {out.sampler!r} run is lensed from its own forwards (windows against a KV "
                         f"cache; not implemented over replays); the lens reads the run's own forwards: {how}.", argument="source",
                         value=source, allowed="'cache' or 'auto'")
    c = out.cache
    want = [resid_name(l) for l in layers] + (["hook_sigma"] if _needs_sigma(model) else [])
    have = set(getattr(c, "names", ())) if c is not None and "cond" in getattr(c, "phases", ()) else set()
    missing = [n for n in want if n not in have]
    if missing:
        raise InputError(f"out.cache lacks {missing}: a {out.sampler!r} run is read from its own forwards; {how}, "
                         "every step.", argument="out", value=out.sampler, allowed="a run generated with that cache")


def _no_forward_reason(out: Any, s: int, cached: set[int], how: str) -> str:
    """Why an uncached step has no residuals: bd3lm reused p(x0) (the previous step of the block changed nothing);
    any other gap is a cache that did not cover the step, refused."""
    tr = out.trajectory
    reused = (out.sampler == "bd3lm" and s > 0 and int(tr.block_of_step[s]) == int(tr.block_of_step[s - 1])
              and int(tr.n_committed[s - 1].sum()) == 0)
    if reused:
        return f"step {s} ran no forward: BD3LM reused p(x0) of its previous forward (the step before changed nothing)"
    raise InputError(f"step {s} of this {out.sampler!r} run was not cached (cached: {sorted(cached)}); {how}, every "
                     "step.", argument="steps", value=s, allowed=f"steps in {sorted(cached)}")


@contextlib.contextmanager
def _step_sigma(model: Any, act: Any) -> Any:
    """HookedDDiT's readout conditions on the step's σ (`model.state.extra["sigma"]`): the σ the forward used, from
    its cached `hook_sigma`; without time conditioning σ is zeroed anyway (0 stands in)."""
    if not callable(getattr(model, "readout", None)):
        yield
        return
    sigma = act["hook_sigma"] if _needs_sigma(model) else torch.zeros(1)
    previous, model.state = model.state, types.SimpleNamespace(extra={"sigma": sigma.to(model.input_device)})
    try:
        yield
    finally:
        model.state = previous


@torch.no_grad()
def run_only_trace(model: Any, out: Any, layers: list[int], steps: list[int], positions: list[int], lens: Any,
                   source: str, how: str) -> LensTrace:
    """:func:`mdm_lens.lens.trace.lens_trace` on a nemotron / bd3lm run (module docstring)."""
    _check_cache(model, out, layers, source, how)
    c, notes = out.cache, step_notes(out)
    cached = set(c.steps)
    absolute = torch.tensor([out.prompt_length + p for p in positions])
    src = absolute - 1 if model.cfg.logit_shift else absolute
    target = out.tokens[:, absolute].cpu()
    width = out.trajectory.x_steps.shape[-1]
    why: dict[int, str] = {}
    per_step = []
    for s in steps:
        reason = notes.get(s) or (None if s in cached else _no_forward_reason(out, s, cached, how))
        cells: dict[int, tuple] = {}
        reduce: Callable = lambda resid, l: cells.__setitem__(  # noqa: E731
            l, reduce_layer(model, resid, l, lens, src, target))
        if reason is not None:
            why[s] = reason
            blank = torch.full((out.tokens.shape[0], width, model.cfg.d_model), float("nan"))
            for l in layers:
                reduce(blank.to(model.input_device), l)
        else:
            act, rows = c[s], c.rows_of(s)
            with _step_sigma(model, act):
                for l in layers:
                    reduce(_at_positions(act[resid_name(l)].to(model.input_device), rows.start, max(width, rows.stop)),
                           l)
        per_step.append([cells[l] for l in layers])
    stack = lambda k: torch.stack([torch.stack([c_[k] for c_ in row]) for row in per_step])  # noqa: E731
    top1, top1_prob, final_prob, final_rank = stack(0), stack(1), stack(2), stack(3)
    undefined = torch.isnan(top1_prob)
    top1, final_rank = top1.masked_fill(undefined, -1), final_rank.masked_fill(undefined, -1)
    x = out.trajectory.x_steps[steps][:, :, absolute]
    return LensTrace("logit" if lens is None else "tuned", steps, layers, positions, out.n_steps, out.prompt_length,
                     top1, top1_prob, final_prob, final_rank, target, out.trajectory.commit_step[:, absolute].clone(),
                     noisy_positions(model.cfg, x, out.prompt_length), "cache",
                     {"model": model.cfg.model_name, "sampler": out.sampler, "step_notes": why,
                      "not_computed": NOT_COMPUTED})
