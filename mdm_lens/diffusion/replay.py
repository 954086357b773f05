"""Replaying one denoising step's forward pass outside `generate`, with the state and hooks it had inside.

    out = model.generate(prompt, steps=8, gen_length=8)
    logits = out.replay(model, 3, fwd_hooks=[("blocks.0.attn.hook_pattern", at_steps(fn, [3]))])

The canvas is `out.trajectory.x_steps[step]` (the input before that step's commits); `model.state` is rebuilt
from the run's settings exactly as the sampler built it (step, block, masked/prompt/visible sets, phase; the
post-commit fields are None during a forward pass, as inside `generate`). The forward runs through the same
`StepRunner` as the sampler, so step-bound hooks fire by the same rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError


def _canvas(out: Any, s: int) -> tuple[Tensor, Tensor]:
    x = out.trajectory.x_steps[s]
    width = out.prompt_length + s if out.causal else x.shape[1]  # an ARM step sees the prefix it extends
    return x[:, :width], out.attention_mask[:, :width].cpu()


def state_at(out: Any, step: int, phase: str = "cond") -> DenoisingState:
    if out.sampler in ("llada2", "sdar"):  # their forwards cover a canvas prefix / one KV-cached block
        raise SamplerConfigError(f"replay is not available for sampler={out.sampler!r} runs: their forwards cover a "
                                 "canvas prefix or one KV-cached block that x_steps does not describe; hook the run "
                                 "itself (fwd_hooks / cache=).", argument="out", value=out.sampler,
                                 allowed="a llada, dream, arm or diffusion_gemma run")
    if out.settings.get("kv_cache") is not None:  # a replay would be a fresh full forward, not what the run read
        raise SamplerConfigError(f"replay is not available for kv_cache={out.settings['kv_cache']!r} runs: their "
                                 "window forwards attended to stale cached keys/values, which a replay (a fresh full "
                                 "forward) would not; hook the run itself (fwd_hooks / cache=), or compare the two "
                                 "with probes.cache_effect.", argument="out", value=out.settings["kv_cache"],
                                 allowed="a run without kv_cache")
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
    return DenoisingState(s, n, block, n_blocks, x.clone(), masked, prompt, key_visible, block_slice, phase=phase,
                          query_position=query)


def replay(out: Any, model: Any, step: int, *, fwd_hooks: Any = (), hook_steps: Any = None,
           phase: str = "cond") -> Tensor:
    from mdm_lens.hooks.runner import StepRunner

    out.check_model(model)
    state = state_at(out, step, phase)
    device = model.input_device
    for name in ("x", "masked", "prompt", "key_visible", "query_position"):
        value = getattr(state, name)
        if value is not None:
            setattr(state, name, value.to(device))
    runner = StepRunner(model, fwd_hooks=fwd_hooks, hook_steps=hook_steps)
    runner.begin(state.x.shape[0], state.x.shape[1], state.n_steps)
    _, am = _canvas(out, state.step)
    with torch.no_grad():
        return runner.forward(state, state.x, attention_mask=am.to(device))
