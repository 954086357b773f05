"""Fast-dLLM v2's sampler settings (`batch_sample`'s names and defaults) and their rules; the loop is in
`mdm_lens.diffusion.fastdllm_v2`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mdm_lens import validate
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.registry import SamplerSettings
from mdm_lens.errors import SamplerConfigError
from mdm_lens.loading.fastdllm_v2 import BD_SIZE, STOP_TOKEN

REFERENCE_MASK_BLOCK = 32  # the `block_size` default of the reference model's forward (denoising forwards)


@dataclass
class FastDLLMv2Settings(SamplerSettings):
    """`batch_sample`'s settings and defaults (threshold 0.95, top_p 0.95, temperature 0, no block cache, no factor);
    the ones it takes without default from the eval harness (`max_new_tokens` 2048, `small_block_size` 8,
    `block_size` = the checkpoint's `bd_size`). `stop_token` None = the reference's 151645 (`<|im_end|>`) when the
    vocabulary holds it, else the checkpoint's EOS; `pad_id` None = the checkpoint's pad id (the tokenizer's)."""

    block_size: int | None = None
    small_block_size: int = 8
    max_new_tokens: int = 2048
    threshold: float = 0.95
    top_p: float = 0.95
    temperature: float = 0.0
    use_block_cache: bool = False
    factor: bool = False
    factor_value: float = 1.0
    stop_token: int | None = None
    pad_id: int | None = None

    def resolve(self, model: Any) -> "FastDLLMv2Settings":
        err = SamplerConfigError
        bs = validate.integer(model.cfg.extra.get("block_length", BD_SIZE) if self.block_size is None
                              else self.block_size, name="block_size", min=1, error=err)
        # block_size first: it is wrong whatever small_block_size is, so blaming that default would mislead.
        if REFERENCE_MASK_BLOCK % bs:
            raise err(f"block_size={bs} does not divide {REFERENCE_MASK_BLOCK}: the reference's denoising forwards "
                      f"mask over {REFERENCE_MASK_BLOCK}-token blocks (no block_size is passed), which then hides keys "
                      "inside the block; not reproduced.", argument="block_size", value=bs,
                      allowed=f"a divisor of {REFERENCE_MASK_BLOCK}")
        sbs = validate.integer(self.small_block_size, name="small_block_size", min=1, max=bs, error=err)
        if bs % sbs:
            raise err(f"block_size={bs} is not a multiple of small_block_size={sbs}: the reference never decodes the "
                      "block's tail and loops forever.", argument="small_block_size", value=sbs,
                      allowed=f"a divisor of {bs}")
        vocab = model.cfg.d_vocab
        stop = self.stop_token
        if stop is None:
            stop = STOP_TOKEN if STOP_TOKEN < vocab else model.cfg.eos_token_id
        if stop is None:
            raise err("no stop token: the vocabulary lacks the reference's 151645 and the checkpoint names no EOS; "
                      "pass stop_token=.", argument="stop_token", value=None, allowed="a token id")
        validate.distinct_ids({"cfg.mask_token_id": model.cfg.mask_token_id, "stop_token": stop},
                              why="the mask id fills every position not yet decoded, so it means no stop; pass the "
                                  "model's end-of-turn / EOS id.", error=err)
        pad = model.cfg.pad_token_id if self.pad_id is None else self.pad_id
        if pad is None:
            raise err("no pad id (the reference writes tokenizer.pad_token_id after a stop token); pass pad_id=.",
                      argument="pad_id", value=None, allowed="a token id")
        validate.distinct_ids({"cfg.mask_token_id": model.cfg.mask_token_id, "pad_id": pad},
                              why="the tail after a stop token would hold mask ids that the trajectory counts as "
                                  "committed tokens; pass the tokenizer's pad id.", error=err)
        return dataclasses.replace(
            self, block_size=bs, small_block_size=sbs,
            max_new_tokens=validate.integer(self.max_new_tokens, name="max_new_tokens", min=bs, error=err),
            threshold=validate.number(self.threshold, name="threshold", error=err),
            top_p=validate.number(self.top_p, name="top_p", min=0, max=1, min_open=True, error=err),
            temperature=validate.number(self.temperature, name="temperature", min=0, error=err),
            use_block_cache=validate.boolean(self.use_block_cache, name="use_block_cache"),
            factor=validate.boolean(self.factor, name="factor"),
            factor_value=validate.number(self.factor_value, name="factor_value", error=err),
            stop_token=validate.integer(stop, name="stop_token", min=0, max=vocab - 1, error=err),
            pad_id=validate.integer(pad, name="pad_id", min=0, max=vocab - 1, error=err))


FastDLLMv2Settings.rules = {
    "block_size": R.integer(1, none=True), "small_block_size": R.integer(1), "max_new_tokens": R.integer(1),
    "threshold": R.number(0, 1, active=lambda s: not s.factor, when="factor=False (factor=True commits by "
                          "factor_value instead)", off={"factor": True}),
    # greedy at temperature 0: the reference's sample_with_top_p filters only the distribution it samples from
    "top_p": R.number(0, 1, low_open=True, active=lambda s: s.temperature > 0, when="temperature > 0",
                      on={"temperature": 0.5}), "temperature": R.number(0), "use_block_cache": R.boolean(),
    "factor": R.boolean(),
    "factor_value": R.number(0, low_open=True, active=lambda s: s.factor is True, when="factor=True",
                             on={"factor": True}),
    "stop_token": R.integer(0, none=True), "pad_id": R.integer(0, none=True),
}
