"""`generate`: one entry point for the three samplers, with every setting checked before compute.

    out = model.generate(prompt, steps=64, gen_length=64, block_length=32,       # LLaDA sampler
                         record=[ReceivedAttention()],
                         cache="blocks.0.attn.hook_pattern" @ steps(0, -1))
    out.records["received_attention"]     # [step, batch, layer, head, key]
    out.cache.stack("blocks.0.attn.hook_pattern")    # [2, batch, head, query, key]
"""

from __future__ import annotations

import sys
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from mdm_lens import tokenization
from mdm_lens.diffusion import arm, dream, llada
from mdm_lens.diffusion.output import GenerateOutput
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner

SamplerName = Literal["auto", "llada", "dream", "arm"]


def default_sampler(model: Any) -> str:
    if model.cfg.family == "diffusion_gemma":
        return "diffusion_gemma"
    if model.cfg.attention == "causal":
        return "arm"
    return "dream" if model.cfg.logit_shift else "llada"


def _prompt_tokens(model: Any, prompt: Any, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str)):
        ids, am = model.to_tokens(prompt, return_attention_mask=True)
        return ids, am
    ids = torch.as_tensor(prompt, device=model.W_E.device)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"prompt must be text or token ids [batch, pos], got {tuple(ids.shape)} {ids.dtype}.")
    am = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to(ids.device)
    if am.shape != ids.shape:
        raise InputError(f"attention_mask {tuple(am.shape)} must match the prompt {tuple(ids.shape)}.")
    return ids.long(), am.long()


def _progress(progress: bool | None, total: int, desc: str) -> Any:
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False)


def generate(
    model: Any,
    prompt: Any,
    *,
    sampler: SamplerName = "auto",
    steps: int | None = None,
    gen_length: int = 32,
    block_length: int | None = None,
    temperature: float = 0.0,
    # LLaDA
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    # Dream
    alg: str = "origin",
    alg_temp: float | None = None,
    eps: float = 1e-3,
    top_p: float | None = None,
    top_k: int | None = None,
    # ARM
    stop_at_eos: bool = False,
    # observation
    attention_mask: Tensor | None = None,
    fwd_hooks: Sequence[Any] = (),
    hook_steps: Any = None,
    record: Sequence[Any] = (),
    cache: Any = None,
    seed: int | None = 0,
    progress: bool | None = None,
    **diffusion_gemma_settings: Any,
) -> GenerateOutput:
    """Run a sampler step by step with hooks, reducers and a trajectory cache.

    Args:
        prompt: text (needs a tokenizer) or token ids `[batch, pos]` (left-padded, with `attention_mask`).
        sampler: "llada", "dream" (`cfg.logit_shift` models), "arm" (causal twins) or "auto".
        steps: denoising steps (default gen_length; ARM: always gen_length).
        gen_length: tokens to generate (Dream's max_new_tokens).
        block_length: LLaDA semi-autoregressive block length (default gen_length: one block).
        fwd_hooks: TL `(name, fn)` pairs (names may be globs or filters) or `at_steps(fn, [...], name=...)`.
        hook_steps: the steps at which plain `fwd_hooks` fire (default every step), e.g. `[0, -1]` or `steps(every=4)`.
        record: streaming reducers, e.g. `[ReceivedAttention(), KeyValueNorms()]`.
        cache: a `TrajectoryCache`, a `"name" @ steps(...)` request, or hook names (every step).
        seed: seeds the sampler's own randomness (Gumbel noise, random remasking, sampling).
    """
    if sampler == "diffusion_gemma" or (sampler == "auto" and default_sampler(model) == "diffusion_gemma"):
        from mdm_lens.diffusion.diffusion_gemma import generate_from_common  # transformers' settings by name

        return generate_from_common(model, prompt, dict(locals()))
    if diffusion_gemma_settings:
        raise SamplerConfigError(f"unknown setting(s) {sorted(diffusion_gemma_settings)} for sampler={sampler!r}.")
    sampler = default_sampler(model) if sampler == "auto" else sampler
    if sampler not in ("llada", "dream", "arm"):
        raise SamplerConfigError(f"sampler must be 'llada', 'dream', 'arm' or 'auto', got {sampler!r}.")
    if sampler != "arm" and model.cfg.attention == "causal":
        raise SamplerConfigError(f"{model.cfg.model_name} is causal: use sampler='arm' (or 'auto').")
    if sampler == "arm" and model.cfg.attention != "causal":
        raise SamplerConfigError("sampler='arm' decodes left to right and needs a causal model; "
                                 "this model is bidirectional (use 'llada' or 'dream').")
    mask_id = model.cfg.mask_token_id
    if sampler != "arm" and mask_id is None:
        raise SamplerConfigError("this model has no mask token (cfg.mask_token_id is None); set it to diffuse.")
    steps = gen_length if steps is None else steps
    block_length = gen_length if block_length is None else block_length
    if sampler == "llada":
        llada.check_settings(steps, gen_length, block_length, remasking, cfg_scale, temperature)
    elif sampler == "dream":
        dream.check_settings(steps, gen_length, alg, eps, temperature, top_p, top_k)
    else:
        if steps != gen_length:
            raise SamplerConfigError(f"an ARM takes one step per token: steps must equal gen_length={gen_length}.")
        if gen_length <= 0:
            raise SamplerConfigError("gen_length must be positive.")
    ids, am = _prompt_tokens(model, prompt, attention_mask)
    batch, prompt_length = ids.shape
    total = prompt_length + gen_length
    if total > model.cfg.n_ctx:
        raise SamplerConfigError(f"prompt ({prompt_length}) + gen_length ({gen_length}) = {total} exceeds the "
                                 f"context of {model.cfg.n_ctx}; shorten one of them.")
    if mask_id is not None and sampler != "arm" and bool((ids == mask_id).any()):
        raise InputError(f"the prompt contains the mask token {mask_id}; LLaDA/Dream treat prompt masks as "
                         "positions to fill. Remove it or use a canvas made by generate.")
    runner = StepRunner(model, fwd_hooks=fwd_hooks, hook_steps=hook_steps, record=record, cache=cache)
    runner.begin(batch, total, steps)  # names, steps and memory are checked here, before any compute
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    bar = _progress(progress, steps, f"{sampler} sampling")
    settings: dict[str, Any] = dict(steps=steps, gen_length=gen_length, temperature=temperature, seed=seed)
    try:
        with torch.no_grad():
            if sampler == "arm":
                settings.update(top_p=top_p, top_k=top_k)
                x, am, recorder = arm.arm_sample(runner, ids, am, gen_length=gen_length, temperature=temperature,
                                                 top_p=top_p, top_k=top_k, eos_id=model.cfg.eos_token_id,
                                                 stop_at_eos=stop_at_eos, generator=generator, progress=bar)
            else:
                x = torch.cat([ids, ids.new_full((batch, gen_length), mask_id)], dim=1)
                am = torch.cat([am, am.new_ones((batch, gen_length))], dim=1)
                if sampler == "llada":
                    settings.update(block_length=block_length, remasking=remasking, cfg_scale=cfg_scale)
                    eot = model.cfg.extra.get("special_tokens", {}).get("<|eot_id|>")
                    x, recorder = llada.llada_sample(
                        runner, x, am, prompt_length, steps=steps, gen_length=gen_length, block_length=block_length,
                        temperature=temperature, cfg_scale=cfg_scale, remasking=remasking, mask_id=mask_id,
                        logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf,
                        eos_id=model.cfg.eos_token_id, eot_id=eot, generator=generator, progress=bar)
                else:
                    settings.update(alg=alg, alg_temp=alg_temp, eps=eps, top_p=top_p, top_k=top_k)
                    x, recorder = dream.dream_sample(runner, x, am, prompt_length, steps=steps, mask_id=mask_id,
                                                     eps=eps, alg=alg, alg_temp=alg_temp, temperature=temperature,
                                                     top_p=top_p, top_k=top_k, generator=generator, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    records, meta = runner.records()
    texts = None
    if model.tokenizer is not None:
        texts = [tokenization.decode(model.tokenizer, row[prompt_length:].tolist()) for row in x.cpu()]
    return GenerateOutput(tokens=x, prompt_length=prompt_length, attention_mask=am, trajectory=recorder.finish(),
                          sampler=sampler, settings=settings, causal=sampler == "arm", records=records,
                          record_meta=meta, cache=runner.cache, model_name=model.cfg.model_name, texts=texts)
