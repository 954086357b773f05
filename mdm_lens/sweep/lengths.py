"""The sweep's lengths (`gen_length`, `steps`, `block_length`) as the model's default sampler names them."""

from __future__ import annotations

from typing import Any

from mdm_lens.probes import run as R
from mdm_lens.sweep.batch import Settings


def _gen_kwargs(model: Any, s: Settings) -> dict[str, Any]:
    """The sweep's lengths as the model's default sampler names them (`registry.own_lengths`, the export's mapping
    too: Fast-dLLM v2 takes `max_new_tokens` / `block_size` and has no `steps`, so the sweep's default steps is
    dropped there; `sweep.run` refuses an explicit one). DiffusionGemma's generate takes LLaDA's names itself."""
    from mdm_lens.diffusion import registry
    from mdm_lens.diffusion.generate import default_sampler

    causal = R.is_causal(model)
    steps = s.gen_length if causal else s.steps
    sampler = default_sampler(model)
    # a token-shifted model's sampler (Dream) has block_length only for its cached loop: not passed; a sampler that
    # renames block_length to its own block setting (Fast-dLLM v2's block_size) takes it
    plugin = None if sampler == "diffusion_gemma" else registry.get(sampler)
    renames_blocks = plugin is not None and "block_length" in plugin.renamed
    blocks = s.block_length if not causal and (not model.cfg.logit_shift or renames_blocks) else None
    if plugin is None:
        kw: dict[str, Any] = dict(gen_length=s.gen_length, steps=steps)
        if blocks is not None:
            kw["block_length"] = blocks
    else:
        kw = registry.own_lengths(plugin, optional=("n_steps",), n_steps=steps, gen_length=s.gen_length,
                                  block_length=blocks)
    return dict(kw, progress=False)


def sweep_block_length(kw: dict[str, Any]) -> int | None:
    """The block length the sweep's runs decode with, under either name (`block_length`, Fast-dLLM v2's
    `block_size`): the block mask of its clean forwards (`run_block_mask`)."""
    return kw.get("block_length", kw.get("block_size"))


def refuse_dropped(model: Any, kw: dict[str, Any], steps: int | None, block_length: int | None) -> None:
    """An explicit `steps` / `block_length` that the sampler would not receive as given is refused (the sweep's
    defaults are dropped quietly, as they are nobody's choice): `generate` refuses the same values."""
    from mdm_lens.diffusion import registry
    from mdm_lens.diffusion.generate import default_sampler
    from mdm_lens.errors import SamplerConfigError

    sampler = default_sampler(model)
    if steps is not None and sampler != "diffusion_gemma":  # a sampler with no steps setting (Fast-dLLM v2)
        registry.own_lengths(registry.get(sampler), steps=steps)
    if block_length is not None and sweep_block_length(kw) is None:
        why = ("an autoregressive model decodes one token per step" if R.is_causal(model) else
               "a token-shifted (Dream-family) model has block_length only in its KV-cached loop (generate's "
               "kv_cache=True), which the sweep does not run")
        raise SamplerConfigError(f"block_length={block_length}: the sweep runs {model.cfg.model_name!r} with "
                                 f"sampler {sampler!r} without blocks ({why}); drop --block-length.",
                                 argument="block_length", value=block_length, allowed="None for this model")
    ran = kw.get("steps", kw.get("n_steps"))
    if steps is not None and ran is not None and ran != steps:
        raise SamplerConfigError(f"steps={steps}: an autoregressive model decodes one token per step, so the sweep "
                                 f"runs gen_length={kw.get('gen_length')} steps; drop --steps (or pass "
                                 f"--steps {ran}).", argument="steps", value=steps, allowed=f"{ran} (gen_length)")
