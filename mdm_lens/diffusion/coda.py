"""CoDA's `diffusion_generate` (SalesforceAIResearch/CoDA @ fa1d5050 `CoDALanguageModel/generation_utils.py`).

It is Dream's sampler (same `sample_tokens`, filters, `linspace(1, eps, steps+1)` schedule, batch-mean transfer count,
`alg` / `alg_temp`, same one-position logit shift) run on a model whose attention ignores every mask and whose
positions are `arange`: so the `coda` sampler is `dream`'s loop, with `DreamSettings`' defaults (CoDA's
`_prepare_generation_config` also starts from the model config's legacy attributes: temperature 1.0, top_p 1.0,
top_k 50 under transformers 4.47; the shipped generation_config.json, `alg "original"`, is read by nothing).
Refused: padded batches (CoDA would attend to the pads, mdm_lens's forward would hide them: the two would diverge
silently) and Fast-dLLM's cached block decoding (`kv_cache`, the serving stack's patched sampler, not this one)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from mdm_lens.diffusion.dream import DreamSampler, DreamSettings
from mdm_lens.diffusion.registry import register
from mdm_lens.errors import SamplerConfigError


class CoDASampler(DreamSampler):
    name, Settings = "coda", DreamSettings
    # Dream's settings carry kv_cache, which this sampler refuses (the sweep's cache probe reads the reason)
    no_kv_cache = "CoDA's diffusion_generate has no cached block decoding (use sampler='dream' for Fast-dLLM's)"

    def check_run(self, ids: Tensor, am: Tensor, s: DreamSettings, obs: Any) -> None:
        if s.kv_cache is not None:
            raise SamplerConfigError(f"kv_cache={s.kv_cache!r}: {self.no_kv_cache}.", argument="kv_cache",
                                     value=s.kv_cache, allowed="None")
        if not bool(am.all()):
            raise SamplerConfigError("a padded batch on CoDA: its attention ignores every mask, so the reference "
                                     "attends to the pads while mdm_lens would hide them; pass prompts of one length.",
                                     argument="attention_mask", value=am, allowed="no padding")


register(CoDASampler())
