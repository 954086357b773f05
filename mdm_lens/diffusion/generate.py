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
from mdm_lens import validate
from mdm_lens.diffusion import arguments, arm, dream, llada
from mdm_lens.diffusion.arguments import DEFAULT, SAMPLERS
from mdm_lens.diffusion.output import GenerateOutput
from mdm_lens.errors import ArgumentTypeError, InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner

SamplerName = Literal["auto", "llada", "dream", "arm"]


def default_sampler(model: Any) -> str:
    if model.cfg.family == "diffusion_gemma":
        return "diffusion_gemma"
    if model.cfg.attention == "causal":
        return "arm"
    return "dream" if model.cfg.logit_shift else "llada"


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
    gen_length: int | None = None,
    block_length: int | None = DEFAULT,
    temperature: float = DEFAULT,
    # LLaDA
    cfg_scale: float = DEFAULT,
    remasking: str = DEFAULT,
    logits_eos_inf: bool = DEFAULT,
    confidence_eos_eot_inf: bool = DEFAULT,
    # Dream
    alg: str = DEFAULT,
    alg_temp: float | None = DEFAULT,
    eps: float = DEFAULT,
    top_p: float | None = DEFAULT,
    top_k: int | None = DEFAULT,
    # ARM
    stop_at_eos: bool = DEFAULT,
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

    Unset (`DEFAULT`) settings take the chosen sampler's reference default, and `out.settings` lists every
    setting the run used (see `mdm_lens.diffusion.arguments`): LLaDA temperature 0; Dream, as its
    `diffusion_generate` runs without a generation_config, temperature 1.0 with top_k=50 and top_p=1.0 (pass
    `top_k=None` to switch the filter off); ARM greedy. An option of another sampler (e.g. `alg=` on LLaDA) is an
    error, not silently ignored. Every argument is checked before any compute (typed errors of `mdm_lens.errors`).

    Args:
        prompt: text (needs a tokenizer) or token ids `[batch, pos]`, left-padded with `attention_mask` (a
            right-padded batch is refused: the canvas is appended after the prompt).
        sampler: "llada", "dream" (`cfg.logit_shift` models), "arm" (causal twins) or "auto".
        steps: denoising steps (default gen_length; ARM: always gen_length). More steps than tokens runs as in the
            reference but warns (`IdleStepsWarning`), naming the steps that commit nothing.
        gen_length: tokens to generate (Dream's max_new_tokens); default the canvas length a zoo twin was trained
            on (`cfg.extra["gen_length"]`), else 32.
        block_length: LLaDA semi-autoregressive block length (default gen_length: one block).
        fwd_hooks: a list of TL `(name, fn)` pairs (names may be globs or filters) or `at_steps(fn, [...], name=...)`.
        hook_steps: the steps at which plain `fwd_hooks` fire (default every step), e.g. `[0, -1]` or `steps(every=4)`.
        record: a list of streaming reducers, e.g. `[ReceivedAttention(), KeyValueNorms()]`.
        cache: a `TrajectoryCache`, a `"name" @ steps(...)` request, or hook names (every step).
        seed: seeds the sampler's own randomness (Gumbel noise, random remasking, sampling).

    `out.replay(model, step, fwd_hooks=...)` re-runs one step's forward pass outside the loop with the same
    `model.state` and the same step-bound hooks.
    """
    if sampler == "diffusion_gemma" or (sampler == "auto" and default_sampler(model) == "diffusion_gemma"):
        from mdm_lens.diffusion.diffusion_gemma import generate_from_common  # transformers' settings by name

        return generate_from_common(model, prompt, dict(locals()))
    if diffusion_gemma_settings:
        raise SamplerConfigError(f"unknown setting(s) {sorted(diffusion_gemma_settings)} for sampler={sampler!r}.")
    sampler = default_sampler(model) if sampler == "auto" else sampler
    sampler = validate.choice(sampler, SAMPLERS, name="sampler", error=SamplerConfigError)
    if sampler != "arm" and model.cfg.attention == "causal":
        raise SamplerConfigError(f"{model.cfg.model_name} is causal: use sampler='arm' (or 'auto').",
                                 argument="sampler", value=sampler, allowed="'arm' or 'auto'")
    if sampler == "arm" and model.cfg.attention != "causal":
        raise SamplerConfigError("sampler='arm' decodes left to right and needs a causal model; "
                                 "this model is bidirectional (use 'llada' or 'dream').", argument="sampler",
                                 value=sampler, allowed="'llada', 'dream' or 'auto'")
    mask_id = model.cfg.mask_token_id
    if sampler != "arm" and mask_id is None:
        raise SamplerConfigError("this model has no mask token (cfg.mask_token_id is None); set it to diffuse.")
    given = dict(steps=steps, gen_length=gen_length, block_length=block_length, temperature=temperature,
                 cfg_scale=cfg_scale, remasking=remasking, logits_eos_inf=logits_eos_inf,
                 confidence_eos_eot_inf=confidence_eos_eot_inf, alg=alg, alg_temp=alg_temp, eps=eps, top_p=top_p,
                 top_k=top_k, stop_at_eos=stop_at_eos)
    resolved = arguments.resolve(model, sampler, given)
    steps, gen_length, v = resolved.steps, resolved.gen_length, resolved.values
    _check_observation(fwd_hooks, record, cache, seed, progress)
    ids, am = arguments.prompt_tokens(model, prompt, attention_mask)
    batch, prompt_length = ids.shape
    total = prompt_length + gen_length
    if total > model.cfg.n_ctx:
        raise SamplerConfigError(f"prompt ({prompt_length}) + gen_length ({gen_length}) = {total} exceeds the "
                                 f"context of {model.cfg.n_ctx}; shorten one of them.", argument="gen_length",
                                 value=gen_length, allowed=f"<= {model.cfg.n_ctx - prompt_length}")
    if mask_id is not None and sampler != "arm" and bool((ids == mask_id).any()):
        raise InputError(f"the prompt contains the mask token {mask_id}; LLaDA/Dream treat prompt masks as "
                         "positions to fill. Remove it or use a canvas made by generate.", argument="prompt",
                         value=ids, allowed=f"token ids other than {mask_id}")
    runner = StepRunner(model, fwd_hooks=fwd_hooks, hook_steps=hook_steps, record=record, cache=cache)
    runner.begin(batch, total, steps, n_blocks=gen_length // v["block_length"] if sampler == "llada" else 1,
                 phases=("cond", "uncond") if sampler == "llada" and v["cfg_scale"] > 0 else ("cond",))  # before compute
    arguments.warn_idle(sampler, steps, gen_length, v)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    bar = _progress(progress, steps, f"{sampler} sampling")
    settings: dict[str, Any] = dict(steps=steps, gen_length=gen_length, **v, seed=seed)
    if sampler != "arm":
        settings["mask_id"] = mask_id
    try:
        with torch.no_grad():
            x, am, recorder = _run(runner, sampler, ids, am, model, steps, gen_length, v, generator, bar)
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


def _run(runner: StepRunner, sampler: str, ids: Tensor, am: Tensor, model: Any, steps: int, gen_length: int,
         v: dict[str, Any], generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, Any]:
    if sampler == "arm":
        return arm.arm_sample(runner, ids, am, gen_length=gen_length, temperature=v["temperature"], top_p=v["top_p"],
                              top_k=v["top_k"], eos_id=model.cfg.eos_token_id, stop_at_eos=v["stop_at_eos"],
                              generator=generator, progress=bar)
    batch, prompt_length = ids.shape
    mask_id = model.cfg.mask_token_id
    x = torch.cat([ids, ids.new_full((batch, gen_length), mask_id)], dim=1)
    am = torch.cat([am, am.new_ones((batch, gen_length))], dim=1)
    if sampler == "llada":
        x, recorder = llada.llada_sample(
            runner, x, am, prompt_length, steps=steps, gen_length=gen_length, block_length=v["block_length"],
            temperature=v["temperature"], cfg_scale=v["cfg_scale"], remasking=v["remasking"], mask_id=mask_id,
            logits_eos_inf=v["logits_eos_inf"], confidence_eos_eot_inf=v["confidence_eos_eot_inf"],
            eos_id=v["eos_id"], eot_id=v["eot_id"], generator=generator, progress=bar)
    else:
        x, recorder = dream.dream_sample(runner, x, am, prompt_length, steps=steps, mask_id=mask_id, eps=v["eps"],
                                         alg=v["alg"], alg_temp=v["alg_temp"], temperature=v["temperature"],
                                         top_p=v["top_p"], top_k=v["top_k"], generator=generator, progress=bar)
    return x, am, recorder


def _check_observation(fwd_hooks: Any, record: Any, cache: Any, seed: Any, progress: Any) -> None:
    """Types of the observation arguments (their names and steps are checked by the StepRunner)."""
    from mdm_lens.hooks.reducers import Reducer
    from mdm_lens.hooks.steps import CacheRequest, StepHook
    from mdm_lens.hooks.trajectory import TrajectoryCache

    lone_pair = isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and isinstance(fwd_hooks[0], str)
    if lone_pair or isinstance(fwd_hooks, StepHook) or not isinstance(fwd_hooks, (list, tuple)):
        raise ArgumentTypeError(f"fwd_hooks={validate.describe(fwd_hooks)} must be a list of (name, fn) pairs or "
                                "at_steps(...) hooks; write fwd_hooks=[...].", argument="fwd_hooks", value=fwd_hooks,
                                allowed="a list of (name, fn) pairs or StepHooks")
    validate.instances(list(record) if isinstance(record, tuple) else record, Reducer, name="record")
    ok_cache = cache is None or callable(cache) or isinstance(cache, (str, TrajectoryCache, CacheRequest)) or (
        isinstance(cache, (list, tuple)) and cache and all(isinstance(c, str) for c in cache))
    if not ok_cache:
        raise ArgumentTypeError(f"cache={validate.describe(cache)} must be a TrajectoryCache, a 'name' @ steps(...) "
                                "request, a hook name or a list of hook names.", argument="cache", value=cache,
                                allowed="TrajectoryCache, CacheRequest, str or list of str")
    if seed is not None:
        validate.integer(seed, name="seed", min=0)
    if progress is not None:
        validate.boolean(progress, name="progress")
