"""`model.memory_plan(...)` and `generate`'s memory guard: the sampler's settings (checked as `generate` checks
them) turned into shapes for `mdm_lens.hooks.plan.build_plan`."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, MemoryBudgetError
from mdm_lens.diffusion import arguments, registry
from mdm_lens.diffusion.observation_checks import check_observation
from mdm_lens.diffusion.registry import Observation
from mdm_lens.hooks.memory import human
from mdm_lens.hooks.plan import MemoryPlan, build_plan
from mdm_lens.loading.placement_checks import check_max_memory


def memory_plan(model: Any, prompt: Any = None, *, sampler: str, prompt_length: int | None = None,
                batch: int | None = None, record: Sequence[Any] = (), cache: Any = None,
                max_memory: dict | None = None, attention_mask: Any = None, **settings: Any) -> MemoryPlan:
    """The plan of `model.generate(prompt, sampler=…, record=…, cache=…, **settings)`; nothing is run.

    `prompt` (token ids `[batch, pos]`) or `prompt_length` + `batch` (default 1) give the shapes; `settings` are
    the sampler's own; `attention_mask` a padded prompt's mask, checked as `generate` checks it (e.g. Fast-dLLM v2
    takes left padding only); `sampler` a registered name (`HookedMDM.memory_plan` resolves "auto"). Checked as `generate`
    checks them: a text prompt needs a tokenizer, `record` a list of reducers, prompt + gen_length within the
    sampler's length limit; `max_memory` keys must be devices of this machine, its values sizes accelerate parses
    (`mdm_lens.loading.placement_checks`)."""
    plugin = registry.get(sampler)
    resolved = plugin.settings(model, settings)
    check_observation((), record, cache, None, None)  # generate's own check: record='x' is refused here too
    ids, am = None, None
    if prompt is not None:  # as generate reads it: text needs a tokenizer (InputError), ids are checked
        ids, am = arguments.prompt_tokens(model, prompt, attention_mask)
        for name, value, real in (("prompt_length", prompt_length, ids.shape[1]), ("batch", batch, ids.shape[0])):
            if value is not None and value != real:  # the prompt's shape is the plan's: a different one is ignored
                raise ArgumentError(f"{name}={value!r} disagrees with the prompt's {name} {real}: the plan uses the "
                                    f"prompt's shape; pass prompt or {name}, not both.", argument=name, value=value,
                                    allowed=f"{real} (the prompt's) or leave it out")
        batch, prompt_length = ids.shape
    elif attention_mask is not None:
        raise ArgumentTypeError("attention_mask is the mask of a prompt: pass prompt (token ids) with it.",
                                argument="attention_mask", value="given without prompt", allowed="prompt=ids too")
    elif prompt_length is None:
        raise ArgumentTypeError("memory_plan needs the run's shapes: pass prompt (token ids or text) or prompt_length "
                                "(and batch, default 1).", argument="prompt", value=None,
                                allowed="token ids [batch, pos], a text, or prompt_length=int")
    prompt_length = validate.integer(prompt_length, name="prompt_length", min=1)
    batch = validate.integer(1 if batch is None else batch, name="batch", min=1)
    gen = plugin.answer_length(resolved)
    _check_like_generate(model, plugin, ids, batch, prompt_length, resolved, record, cache, am)
    steps = getattr(resolved, "steps", None) or gen  # Fast-dLLM v2 has no step count: at most one per token
    # the forwards and canvas width generate sizes its step-bound caches and records for (blocks' steps, MDLM's
    # noise-removal forward, a block-rounded canvas): the requested caches are planned over the same
    forwards, width = plugin.run_extent(resolved, batch, prompt_length)
    # BD3LM takes kv_cache=False (a bool), the Fast-dLLM family None or a cache mode
    kv = getattr(resolved, "kv_cache", None) not in (None, False) or bool(getattr(resolved, "use_block_cache", False))
    max_memory = check_max_memory(max_memory, real=True)  # a budget for a device this machine lacks is refused
    extents = plugin.forward_extents(resolved, prompt_length)  # None: one forward over the canvas
    s = torch.finfo(model.cfg.dtype).bits // 8
    return build_plan(model, batch, prompt_length + gen, steps, kv, cache, list(record), max_memory, resolved,
                      extents, plugin.logit_bytes(resolved, s),
                      plugin.trajectory_bytes(resolved, batch, prompt_length, steps),
                      plugin.carried_bytes(resolved, s),
                      lambda e: plugin.attention_extra_bytes(resolved, model.cfg, batch, e, s),
                      plugin.row_logit_bytes(resolved, s), (forwards, width))


def _check_like_generate(model: Any, plugin: Any, ids: Any, batch: int, prompt_length: int, resolved: Any,
                         record: Sequence[Any], cache: Any, am: Any = None) -> None:
    """The sampler's own `check_inputs`, as `generate` runs it before compute (the length limit, the layout, the
    batch it takes: BD3LM's kv_cache whole blocks, a block sampler's one unpadded row, ...), so that a plan exists
    only for a run `generate` accepts; with only `prompt_length` given, on placeholder ids that are not the mask id."""
    if ids is None:
        ids = torch.full((batch, prompt_length), 1 if model.cfg.mask_token_id == 0 else 0, dtype=torch.long)
    am = torch.ones_like(ids) if am is None else am
    plugin.check_inputs(model, ids, am, resolved, Observation(record=list(record), cache=cache))


def guard(model: Any, prompt: Any, sampler: str, settings: dict[str, Any], record: Sequence[Any], cache: Any,
          resolved: Any) -> None:
    """`generate`'s check before compute, for models with budgets to respect: loaded with `max_memory` (or
    `n_devices`), or on a CUDA device (its free memory). Needs token ids for the shapes: a text prompt is left to
    the trajectory cache's own budget check."""
    on_gpu = str(getattr(model.cfg, "device", "cpu")).startswith("cuda")  # cfg.device may be a str
    if getattr(model, "max_memory", None) is None and not on_gpu:
        _check_host_trajectory(prompt, registry.get(sampler), resolved)
        return
    if not isinstance(prompt, torch.Tensor):
        return
    memory_plan(model, prompt, sampler=sampler, record=record, cache=cache, **settings).check()


def _check_host_trajectory(prompt: Any, plugin: Any, resolved: Any) -> None:
    """Without a budget, the one allocation that grows with `steps` alone: the trajectory (`x_steps`, int64 per
    step) and the per-step schedule, checked against the host's available memory, so that `steps=10**9` is a
    typed error rather than the process killed by the kernel (idle steps run as the reference does otherwise)."""
    if not isinstance(prompt, torch.Tensor) or prompt.ndim not in (1, 2):
        return
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: no reading, no check
        return
    batch, prompt_length = (1, prompt.shape[0]) if prompt.ndim == 1 else tuple(prompt.shape)
    steps = int(getattr(resolved, "steps", None) or plugin.answer_length(resolved))
    need = plugin.trajectory_bytes(resolved, batch, prompt_length, steps) + steps * batch * 8
    if need > free:
        raise MemoryBudgetError(f"steps={steps} would keep {human(need)} of trajectory (one canvas per step) on the "
                                f"host, which has {human(free)} available (refused before compute); lower steps "
                                f"(this run generates {plugin.answer_length(resolved)} tokens).")
