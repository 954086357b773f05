"""`model.memory_plan(...)` and `generate`'s memory guard: the sampler's settings (checked as `generate` checks
them) turned into shapes for `mdm_lens.hooks.plan.build_plan`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mdm_lens import validate
from mdm_lens.diffusion import registry
from mdm_lens.hooks.plan import MemoryPlan, build_plan


def memory_plan(model: Any, prompt: Any = None, *, sampler: str, prompt_length: int | None = None,
                batch: int | None = None, record: Sequence[Any] = (), cache: Any = None,
                max_memory: dict | None = None, **settings: Any) -> MemoryPlan:
    """The plan of `model.generate(prompt, sampler=…, record=…, cache=…, **settings)`; nothing is run.

    `prompt` (token ids `[batch, pos]`) or `prompt_length` + `batch` (default 1) give the shapes; `settings` are
    the sampler's own; `sampler` a registered name (`HookedMDM.memory_plan` resolves "auto")."""
    resolved = registry.get(sampler).settings(model, settings)
    if prompt is not None:
        shape = tuple(torch.as_tensor(prompt).shape)
        batch, prompt_length = (1, shape[0]) if len(shape) == 1 else shape[:2]
    prompt_length = validate.integer(prompt_length, name="prompt_length", min=1)
    batch = validate.integer(1 if batch is None else batch, name="batch", min=1)
    gen = getattr(resolved, "gen_length", None) or getattr(resolved, "max_new_tokens", 0)
    steps = getattr(resolved, "steps", None) or gen  # Fast-dLLM v2 has no step count: at most one per token
    kv = getattr(resolved, "kv_cache", None) is not None or bool(getattr(resolved, "use_block_cache", False))
    return build_plan(model, batch, prompt_length + gen, steps, kv, cache, list(record), max_memory, resolved)


def guard(model: Any, prompt: Any, sampler: str, settings: dict[str, Any], record: Sequence[Any], cache: Any) -> None:
    """`generate`'s check before compute, for models with budgets to respect: loaded with `max_memory` (or
    `n_devices`), or on a CUDA device (its free memory). Needs token ids for the shapes: a text prompt is left to
    the trajectory cache's own budget check."""
    on_gpu = str(getattr(model.cfg, "device", "cpu")).startswith("cuda")  # cfg.device may be a str
    if getattr(model, "max_memory", None) is None and not on_gpu:
        return
    if not isinstance(prompt, torch.Tensor):
        return
    memory_plan(model, prompt, sampler=sampler, record=record, cache=cache, **settings).check()
