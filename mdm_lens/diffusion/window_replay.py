"""Replaying the steps of samplers whose forwards are windows or cached blocks, not the canvas: BD3LM and Nemotron.

Each step's own forward is rebuilt from the trajectory (`out.trajectory.forwards[k]`: its rows, keys and settings;
the canvas it read) and run again with the same tokens, keyword arguments and shapes as the run ran it, so the
replay's logits are the run's logits of that step (bit-for-bit on the same device, dtype and threads: it is the
same sequence of operations). The replay returns the rows the step computed; `state.rows` / `state.keys` give their
absolute canvas positions.

BD3LM (`sampler="bd3lm"`):
* without `kv_cache`: the step forwarded the window `[start, end)` (the last `context_size` positions up to its
  block's end, aligned to whole blocks; positions restart at 0 inside it, so a window that slid past
  `model_length` is rebuilt as it was) under the block-causal mask at the step's σ. The replay returns the whole
  window's logits (the sampler kept the block's rows `[block start, end)`, the last rows of the window).
* with `kv_cache`: the step forwarded one block against the stored keys/values of the finished blocks. The cache
  is rebuilt by re-running every storing forward of the run before step k, in order (the finished blocks'
  committed tokens at their own σ, the cache sliding at `model_length` as it did), then step k's block: the same
  computation as the run's, hence exact too. A storing step (`state.extra["kv_store"]`) replays its forward
  without advancing the rebuilt cache (its logits do not depend on the store, which happens after).
* a step that ran no forward (it sampled again from the p(x0) of an earlier step, whose canvas is unchanged:
  `state.extra["reused_from"]`) has nothing to replay: `replay` refuses, naming the step whose forward it used;
  `state_at` still gives its state (its own t and σ).

Nemotron (`sampler="nemotron"`, `"nemotron_ar"`): every forward of the run is a step of its trajectory, so step k
is one of three kinds (`state.extra["kind"]`):
* "denoise": the block's rows `[lo, hi)` attended bidirectionally to [KV cache of `[0, lo)`; themselves]. The cache
  was filled by the latest causal forward before it (the prefill, or the previous block's commit), over exactly
  `[0, lo)` of tokens that no later step changes; the replay re-runs that causal forward (unhooked) into a fresh
  cache, then the block: exact.
* "prefill" / "commit" / "ar": a causal forward over `[0, hi)` (filling the cache; its last row seeds the next
  block or token). These forwards commit nothing by denoising, but they are steps of the trajectory (their hooks
  fire at their step), so `replay(k)` on them re-runs that causal forward, rows `[0, hi)`: exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

WINDOW_SAMPLERS = ("bd3lm", "nemotron", "nemotron_ar")
CAUSAL_KINDS = ("prefill", "commit", "ar")


def _forwards(out: Any, step: int) -> list[dict]:
    forwards = out.trajectory.forwards
    if forwards is None or len(forwards) != out.trajectory.n_steps:
        raise SamplerConfigError(f"this sampler={out.sampler!r} run has no record of its forwards (trajectory.forwards"
                                 "), so a replay cannot rebuild them.", argument="out", value=out.sampler,
                                 allowed="a run made by generate() of this version")
    return forwards


def _cond(out: Any, phase: str) -> None:
    if validate.choice(phase, ("cond", "uncond"), name="phase") != "cond":
        raise SamplerConfigError(f"phase={phase!r}: sampler={out.sampler!r} runs one forward per step (no CFG).",
                                 argument="phase", value=phase, allowed="'cond'")


def state_at(out: Any, step: int, phase: str = "cond") -> DenoisingState:
    """Step `step`'s `DenoisingState` as the sampler set it for the step's forward (module docstring)."""
    n = out.trajectory.n_steps
    step = validate.index(step, n, name="step", what=f"step of this {n}-step run")
    _cond(out, phase)
    f = _forwards(out, step)[step]
    if out.sampler == "bd3lm":
        x = out.trajectory.x_steps[step].clone()
        masked = x == out.settings["mask_id"]
    else:
        x, masked = f["x"].clone(), f["x"] == out.settings["mask_id"]
    prompt = torch.zeros_like(masked)
    prompt[:, :out.prompt_length] = True
    extra = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in f["extra"].items()}
    extra["n_run"] = n
    # after the run its length is known: the rebuilt state counts the forwards it made (its hooks saw the bound)
    state = DenoisingState(step, out.trajectory.n_steps, f["block"], f["n_blocks"], x, masked, prompt,
                           torch.ones_like(prompt), f["block_slice"], extra=extra)
    state.query_rows, state.key_cols, state.key_index = f["rows"], f["keys"], f.get("key_index")
    return state


def _refuse_reused(out: Any, state: DenoisingState) -> None:
    source = state.extra.get("reused_from")
    if source is not None:
        raise SamplerConfigError(f"step {state.step} of this {out.sampler!r} run ran no forward: nothing changed since "
                                 f"step {source}, so it sampled again from that step's p(x0). Replay step {source} "
                                 "for the logits it used.", argument="step", value=state.step,
                                 allowed=f"a step that ran a forward (not {state.step}: "
                                         f"state_at(step).extra['reused_from'] = {source})")


def forward_inputs(out: Any, model: Any, state: DenoisingState) -> tuple[Tensor, dict, ContextManager]:
    """Step `state.step`'s forward input `(tokens, kwargs, context)`: the forward is
    `with context: model(tokens, **kwargs)` (the context attaches a rebuilt KV cache where the step read one)."""
    _refuse_reused(out, state)
    if out.sampler == "bd3lm":
        return _bd3lm_inputs(out, model, state)
    return _nemotron_inputs(out, model, state)


def _bd3lm_inputs(out: Any, model: Any, state: DenoisingState) -> tuple[Tensor, dict, ContextManager]:
    rows, sigma = state.rows, state.extra["sigma"].to(model.input_device)
    tokens = state.x[:, rows]
    if not state.extra["kv_cache"]:
        return tokens, {"sigma": sigma}, contextlib.nullcontext()
    cache = model.new_kv_cache(state.x.shape[0])
    forwards = out.trajectory.forwards
    for j in range(state.step):  # re-store the finished blocks exactly as the run stored them (sliding included)
        if forwards[j]["extra"]["kv_store"]:
            stored = state_at(out, j)
            _unhooked(model, stored, stored.x[:, stored.rows].to(model.input_device),
                      sigma=stored.extra["sigma"].to(model.input_device), kv_cache=cache, store_kv=True)
    return tokens, {"sigma": sigma, "kv_cache": cache}, contextlib.nullcontext()


def _causal_inputs(state: DenoisingState, device: Any) -> tuple[Tensor, dict]:
    """A prefill / commit / AR forward: causal over `[0, hi)` at positions 0..hi-1."""
    hi = state.rows.stop
    causal = torch.ones(hi, hi, dtype=torch.bool, device=device).tril()
    return state.x[:, :hi], {"position_ids": torch.arange(hi, device=device)[None], "attn_mask": causal}


def _nemotron_inputs(out: Any, model: Any, state: DenoisingState) -> tuple[Tensor, dict, ContextManager]:
    from mdm_lens.kvcache import KVCache

    cache, device, rows = KVCache(model, state.x.shape[1]), model.input_device, state.rows
    if state.extra["kind"] in CAUSAL_KINDS:
        return (*_causal_inputs(state, device), cache.attached("fill"))
    forwards = out.trajectory.forwards
    filler = max(j for j in range(state.step) if forwards[j]["extra"]["kind"] in CAUSAL_KINDS)
    fill = _to(state_at(out, filler), device)
    if fill.rows.stop != rows.start:  # the run's invariant: the cache holds exactly the positions before the block
        raise SamplerConfigError(f"step {state.step}'s block starts at {rows.start} but its cache was filled over "
                                 f"[0, {fill.rows.stop}) by step {filler}: this trajectory is not a nemotron run's.",
                                 argument="out", value=out.sampler, allowed="a run made by generate()")
    tokens, kwargs = _causal_inputs(fill, device)
    with cache.attached("fill"):
        _unhooked(model, fill, tokens, **kwargs)
    positions = torch.arange(rows.start, rows.stop, device=device)[None]
    return state.x[:, rows], {"position_ids": positions}, cache.attached("block")


def _to(state: DenoisingState, device: Any) -> DenoisingState:
    for name in ("x", "masked", "prompt", "key_visible"):
        setattr(state, name, getattr(state, name).to(device))
    return state


def _unhooked(model: Any, state: DenoisingState, tokens: Tensor, **kwargs: Any) -> Tensor:
    """One of the run's earlier forwards, re-run with its own state and no hooks (it only rebuilds a cache)."""
    from mdm_lens.hooks.runner import StepRunner

    runner = StepRunner(model)
    runner.begin(state.x.shape[0], state.x.shape[1], state.n_steps)
    with torch.no_grad():
        return runner.forward(_to(state, model.input_device), tokens, **kwargs)
