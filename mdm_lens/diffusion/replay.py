"""Replaying one denoising step's forward pass outside `generate`, with the state and hooks it had inside.

    out = model.generate(prompt, steps=8, gen_length=8)
    logits = out.replay(model, 3, fwd_hooks=[("blocks.0.attn.hook_pattern", at_steps(fn, [3]))])

The canvas is `out.trajectory.x_steps[step]` (the input before that step's commits); `model.state` is rebuilt
from the run's settings exactly as the sampler built it (step, block, masked/prompt/visible sets, phase; the
post-commit fields are None during a forward pass, as inside `generate`). The forward runs through the same
`StepRunner` as the sampler, so step-bound hooks fire by the same rule.

Block samplers (`llada2`, `sdar`, `fastdllm_v2`): the step's whole canvas and state come from
`out.trajectory.forwards[step]` (the sampler's own `DenoisingState`: block, block_slice, masked set over the whole
canvas, `extra` kind / query_start / query_end, kv_age); `state_at(step).query_rows` are the rows the run's forward
computed, `[query_start, query_end)`. The replay is one forward over the canvas up to `query_end` with the
block-causal mask, returning position-aligned logits for positions `[0, query_end)`; inside it `model.state`'s
`query_rows` / `key_cols` are `[0, query_end)` (the rows it computes, `extra["replay_rows"]`, `replay_rows(out, k)`):
* LLaDA2 forwards exactly that canvas prefix: the replay is its forward;
* SDAR forwarded only the rows `[query_start, query_end)` against its KV cache of finished blocks. Under a
  block-causal mask a finished block's keys/values depend on no later token, so the cache equals the rows of a
  full forward; the replay's rows `[query_start, query_end)` are the logits the sampler read (to float rounding),
  and hooks see every row `[0, query_end)` (`state.extra["replay_rows"]` says so; the run's own hooks saw only the
  block's rows).
* Fast-dLLM v2 caches the same way (its "block" cache of finished blocks is exact, as SDAR's), so its block,
  prefill and AR forwards replay like SDAR's. The replay returns the model's aligned logits (row i reads raw row
  i - 1); the sampler shifted inside the block (`cat(raw[:1], raw[:-1])`), so at a block's first position it read
  raw row i itself. With `use_block_cache=True`, a sub-block forward (`extra["block_cache"] == "window"`) read the
  block's keys/values cached at the block's first forward, stale for the other sub-blocks: its step is refused.

Window samplers (`bd3lm`, `nemotron`, `nemotron_ar`): each step's own forward (a BD3LM window, or a block against
a KV cache rebuilt from the run's storing / causal forwards; Nemotron's prefill and commit passes are steps too) is
rebuilt with the same shapes and operations, so it equals the run's logits exactly; see
`mdm_lens.diffusion.window_replay`. The replay returns the rows the step computed (`state.rows`).

Gradients at one step: `out.replay(model, k, grad=True)` returns logits that carry the autograd graph (the
samplers themselves run under `torch.no_grad`); `with out.at_step(model, k) as (x, kw): ...` sets `model.state`
to step k's state and hands over the step's forward input, so TL's own `run_with_cache(x, **kw, incl_bwd=True,
return_type="loss", targets=...)` or `run_with_hooks(..., bwd_hooks=...)` differentiate exactly step k's
forward (same canvas, padding, block-causal mask and block length). KV-cached runs are refused as by replay, except
BD3LM's and Nemotron's exact caches, rebuilt without gradients (the step's own rows carry the graph).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion import window_replay
from mdm_lens.diffusion.registry import get
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError


def _canvas(out: Any, s: int) -> tuple[Tensor, Tensor]:
    x = out.trajectory.x_steps[s]
    width = out.prompt_length + s if out.causal else x.shape[1]  # an ARM step sees the prefix it extends
    return x[:, :width], out.attention_mask[:, :width].cpu()


BLOCK_SAMPLERS = ("llada2", "sdar", "fastdllm_v2")


def _recorded_forward(out: Any, s: int, phase: str) -> dict:
    """Step s's forward as the run recorded it (`trajectory.forwards[s]`), on a run of one forward per step. The
    states rebuilt from it count the run's forwards (`n_steps`): during an adaptive run its hooks saw the bound."""
    forwards = out.trajectory.forwards
    if forwards is None or len(forwards) != out.trajectory.n_steps:
        raise SamplerConfigError(f"this sampler={out.sampler!r} run has no record of its forwards "
                                 "(trajectory.forwards), so its steps' states cannot be rebuilt.", argument="out",
                                 value=out.sampler, allowed="a run made by generate() of this version")
    if validate.choice(phase, ("cond", "uncond"), name="phase") != "cond":
        raise SamplerConfigError(f"phase={phase!r}: sampler={out.sampler!r} runs one forward per step (no CFG).",
                                 argument="phase", value=phase, allowed="'cond'")
    return forwards[s]


def _block_state(out: Any, s: int, phase: str) -> DenoisingState:
    """The block sampler's own state at step s (module docstring), from the forwards the trajectory kept."""
    f = _recorded_forward(out, s, phase)
    x = f["x"]
    prompt = torch.zeros_like(x, dtype=torch.bool)
    prompt[:, :out.prompt_length] = True
    masked, prompt, visible = (f.get("masked", x == out.settings["mask_id"]), f.get("prompt", prompt),
                               f.get("key_visible", torch.ones_like(prompt)))
    extra = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in f["extra"].items()}
    extra["replay_rows"] = (0, int(extra["query_end"]))
    extra.pop("unknown_length", None)  # after the run its length is known: is_last answers from n_run
    extra["n_run"] = out.trajectory.n_steps
    state = DenoisingState(s, out.trajectory.n_steps, f["block"], f["n_blocks"], x.clone(), masked.clone(),
                           prompt.clone(), visible.clone(), f["block_slice"], extra=extra)
    # the rows the run's own forward computed (SDAR / Fast-dLLM v2: the block's, against the cache); a replay
    # widens its copy to extra["replay_rows"] (`_inputs`)
    return state.computes(int(extra["query_start"]), int(extra["query_end"]))


def _refuse_stale_window(state: DenoisingState) -> None:
    """A Fast-dLLM v2 sub-block forward read keys/values no fresh forward has: its state exists, its replay not."""
    if state.extra.get("block_cache") == "window":
        raise SamplerConfigError(
            f"step {state.step} of this fastdllm_v2 use_block_cache=True run is a sub-block forward: it attended to the "
            "block's keys/values cached at the block's first forward (the other sub-blocks' rows as they were then, "
            "stale since), which no fresh forward reproduces. Hook the run itself (fwd_hooks / cache=) for what it read, or replay "
            "a use_block_cache=False run (its block cache is exact).", argument="step", value=state.step,
            allowed="a step whose forward is not a sub-block window")


def replay_rows(out: Any, step: int) -> slice:
    """The canvas rows `out.replay(model, step)` computes (and its hooks see): `[0, query_end)` on a block run,
    wider than the run's own rows (`state_at(step).rows`) where the run read a KV cache; else the step's rows."""
    state = state_at(out, step)
    return slice(*state.extra["replay_rows"]) if "replay_rows" in state.extra else state.rows


def _length_state(out: Any, s: int, phase: str) -> DenoisingState:
    """A variable-length run's state at step s: its canvas that step (the window it forwarded) and slot map."""
    f = _recorded_forward(out, s, phase)
    extra = dict(f["extra"], n_run=out.trajectory.n_steps)
    state = DenoisingState(s, out.trajectory.n_steps, f["block"], f["n_blocks"], f["x"].clone(), f["masked"].clone(),
                           f["prompt"].clone(), torch.ones_like(f["masked"]), f["block_slice"], extra=extra,
                           slot=f["slot"].clone(), n_original=out.trajectory.length.n_original)
    return state.computes(0, int(extra["query_end"])) if "query_end" in extra else state


def _kv_cached(out: Any) -> bool:
    return out.sampler in ("llada", "dream") and out.settings.get("kv_cache") not in (None, False)


def _cached_state(out: Any, s: int, phase: str) -> DenoisingState:
    """A LLaDA / Dream `kv_cache` run's state at step s: the step's canvas (`x_steps`), its block, and the rows
    its forward computed (the block-start refresh: all; then the window), from `trajectory.forwards`."""
    f = _recorded_forward(out, s, phase)
    x, am = _canvas(out, s)
    prompt = torch.zeros_like(x, dtype=torch.bool)
    prompt[:, :out.prompt_length] = True
    extra = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in f["extra"].items()}
    extra["n_run"] = out.trajectory.n_steps  # after the run its length is known: is_last answers
    state = DenoisingState(s, out.trajectory.n_steps, f["block"], f["n_blocks"], x.clone(),
                           x == out.settings["mask_id"], prompt, am.bool(), f["block_slice"], extra=extra)
    return state.computes(int(extra["query_start"]), int(extra["query_end"]), x.shape[1])


def state_at(out: Any, step: int, phase: str = "cond") -> DenoisingState:
    if out.sampler in window_replay.WINDOW_SAMPLERS:  # BD3LM, Nemotron: the step's own window / cached block
        return window_replay.state_at(out, step, phase)
    if get(out.sampler).no_replay:
        raise SamplerConfigError(f"replay is not available for sampler={out.sampler!r} runs: "
                                 f"{get(out.sampler).no_replay} Hook the run itself (fwd_hooks / cache=) for what "
                                 "its forwards computed.", argument="out", value=out.sampler,
                                 allowed="a run of a sampler whose forwards a replay rebuilds")
    if getattr(out.trajectory, "length", None) is not None:
        n = out.trajectory.n_steps
        return _length_state(out, validate.index(step, n, name="step", what=f"step of this {n}-step run"), phase)
    if out.sampler in BLOCK_SAMPLERS:
        n = out.trajectory.n_steps
        return _block_state(out, validate.index(step, n, name="step", what=f"step of this {n}-step run"), phase)
    if _kv_cached(out):
        n = out.trajectory.n_steps
        return _cached_state(out, validate.index(step, n, name="step", what=f"step of this {n}-step run"), phase)
    n = out.trajectory.n_steps
    s = validate.index(step, n, name="step", what=f"step of this {n}-step run")
    phase = validate.choice(phase, ("cond", "uncond"), name="phase")
    x, am = _canvas(out, s)
    batch, width = x.shape
    prompt = torch.zeros(batch, width, dtype=torch.bool)
    prompt[:, :out.prompt_length] = True  # the samplers' prompt index: every position before the canvas
    key_visible = am.bool()
    block, n_blocks, block_slice = int(out.trajectory.block_of_step[s]), 1, None
    if out.sampler == "llada":
        bl = out.settings["block_length"]
        n_blocks = out.settings["gen_length"] // bl
        block_slice = slice(out.prompt_length + block * bl, out.prompt_length + (block + 1) * bl)
    if phase == "uncond":
        if out.sampler != "llada" or not out.settings.get("cfg_scale"):
            raise SamplerConfigError("phase='uncond' exists only in a LLaDA run with cfg_scale > 0.",
                                     argument="phase", value=phase, allowed="'cond'")
        x = x.masked_fill(prompt & key_visible, out.settings["mask_id"])  # as llada_sample builds it
    if out.causal:
        masked = torch.zeros_like(prompt)
        query = torch.full((batch,), width - 1)
    else:
        masked, query = x == out.settings["mask_id"], None
    state = DenoisingState(s, n, block, n_blocks, x.clone(), masked, prompt, key_visible, block_slice, phase=phase,
                           query_position=query, extra=dict(n_run=n))
    return get(out.sampler).replay_state(out, state)  # the sampler's own extras (DDiT: t and σ of the step)


def step_inputs(out: Any, model: Any, step: int, phase: str = "cond") -> tuple[DenoisingState, Tensor, dict]:
    """Step `step`'s state (on the model's device) and the forward's input: tokens and keyword arguments
    (attention_mask; block samplers: position_ids and the run's block length; BD3LM: σ and a rebuilt KV cache),
    as the sampler ran it. A Nemotron step also needs its KV cache attached around the forward: use `at_step`."""
    state, tokens, kwargs, context = _inputs(out, model, step, phase)
    if not isinstance(context, nullcontext):
        raise SamplerConfigError(f"step {step} of this {out.sampler!r} run attends to a KV cache attached to the "
                                 "model around its forward; `out.at_step(model, step)` attaches it (and `replay` "
                                 "runs it).", argument="out", value=out.sampler,
                                 allowed="at_step / replay for this sampler")
    return state, tokens, kwargs


def _inputs(out: Any, model: Any, step: int, phase: str) -> tuple[DenoisingState, Tensor, dict, ContextManager]:
    """`step_inputs` and the context the forward runs in (a rebuilt KV cache attached; else nothing)."""
    out.check_model(model)
    if _kv_cached(out):  # a replay would be a fresh full forward, not the run's
        raise SamplerConfigError(f"replay is not available for kv_cache={out.settings['kv_cache']!r} runs: their "
                                 "window forwards attended to stale cached keys/values, which a replay (a fresh full "
                                 "forward) would not; hook the run itself (fwd_hooks / cache=), or compare the two "
                                 "with probes.cache_effect. out.state_at(step) gives each step's state.",
                                 argument="out", value=out.settings["kv_cache"], allowed="a run without kv_cache")
    state = state_at(out, step, phase)
    _refuse_stale_window(state)
    if "replay_rows" in state.extra:  # the replay forwards the canvas prefix, not only the run's rows
        state.computes(*state.extra["replay_rows"])
    device = model.input_device
    for name in ("x", "masked", "prompt", "key_visible", "query_position", "slot"):
        value = getattr(state, name)
        if value is not None:
            setattr(state, name, value.to(device))
    if out.sampler in window_replay.WINDOW_SAMPLERS:
        return (state, *window_replay.forward_inputs(out, model, state))
    return (state, *_canvas_inputs(out, state, device), nullcontext())


def _canvas_inputs(out: Any, state: DenoisingState, device: Any) -> tuple[Tensor, dict]:
    if getattr(out.trajectory, "length", None) is not None:  # variable-length: the step's own window, unpadded
        if "query_end" in state.extra:  # InDel: the canvas prefix up to the block's end, block-causal
            end = int(state.extra["query_end"])
            return state.x[:, :end], {"position_ids": torch.arange(end, device=device)[None],
                                      "block_length": state.extra["block_length"]}
        return state.x, {}
    if out.sampler in BLOCK_SAMPLERS:  # the canvas up to the forward's end, block-causal (module docstring)
        end = int(state.extra["query_end"])
        kwargs = {"position_ids": torch.arange(end, device=device)[None],
                  "block_length": state.extra["block_length"]}
        return state.x[:, :end], kwargs
    _, am = _canvas(out, state.step)
    return state.x, {"attention_mask": am.to(device)}


def replay(out: Any, model: Any, step: int, *, fwd_hooks: Any = (), hook_steps: Any = None,
           phase: str = "cond", grad: bool = False) -> Tensor:
    from mdm_lens.hooks.runner import StepRunner

    grad = validate.boolean(grad, name="grad")
    state, tokens, kwargs, context = _inputs(out, model, step, phase)
    runner = StepRunner(model, fwd_hooks=fwd_hooks, hook_steps=hook_steps)
    runner.begin(state.x.shape[0], state.x.shape[1], state.n_steps)
    # samplers run without autograd; grad=True builds the graph so the returned logits can be differentiated
    with torch.set_grad_enabled(grad), context:
        return runner.forward(state, tokens, **kwargs)


@contextmanager
def at_step(out: Any, model: Any, step: int, phase: str = "cond") -> Iterator[tuple[Tensor, dict]]:
    """Set `model.state` to step `step`'s `DenoisingState` and yield the step's forward input `(tokens, kwargs)`;
    inside, any TL call (`run_with_cache(..., incl_bwd=True)`, `run_with_hooks(..., bwd_hooks=...)`) runs step
    `step`'s forward with gradients. `model.state` is restored on exit, even when the body raises."""
    state, tokens, kwargs, context = _inputs(out, model, step, phase)
    previous = model.state
    model.state = state
    try:
        with context:
            yield tokens, kwargs
    finally:
        model.state = previous
