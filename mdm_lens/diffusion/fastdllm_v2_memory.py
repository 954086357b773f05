"""What a Fast-dLLM v2 run holds, for `memory_plan` (`Sampler.forward_extents`, `trajectory_bytes`, `logit_bytes`,
`row_logit_bytes`, `carried_bytes`, `attention_extra_bytes`, `run_extent`): the sampler's loop is in
`mdm_lens.diffusion.fastdllm_v2`."""

from __future__ import annotations

from typing import Any

from mdm_lens.diffusion.fastdllm_v2_settings import FastDLLMv2Settings


class FastDLLMv2Memory:
    """The memory-plan side of `FastDLLMv2Sampler` (its `plan` gives the forwards)."""

    def run_extent(self, s: FastDLLMv2Settings, batch: int, prompt_length: int) -> tuple[int, int]:
        """The most forwards of this prompt length's run over its right-padded canvas (`generate`'s width)."""
        bs = s.block_size
        return self.plan(s, [prompt_length]).n_steps, (s.max_new_tokens // bs + prompt_length // bs) * bs + 1

    @staticmethod
    def _blocks(s: FastDLLMv2Settings, prompt_length: int) -> tuple[int, int]:
        """(first decoded block, number of blocks) of a batch whose prompts all have `prompt_length` tokens."""
        return prompt_length // s.block_size, s.max_new_tokens // s.block_size + prompt_length // s.block_size

    def forward_extents(self, s: FastDLLMv2Settings, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """The prefill over the prompt's whole blocks (it fills the cache; no row sampled), then at the last
        block: a denoising forward of the block's rows against the cache of the finished blocks (plus, with
        use_block_cache, the block's own kept keys / values) that samples one sub-block, and the AR forward that
        appends the block to the cache and reads its last row."""
        bs, first_n = s.block_size, self._blocks(s, prompt_length)
        lo, hi = (first_n[1] - 1) * bs, first_n[1] * bs
        out = []
        if prompt_length > bs:
            k = prompt_length // bs * bs
            out.append((k, k, k, 0))
        out += [(bs, hi, lo + bs * int(s.use_block_cache), s.small_block_size), (bs, hi, hi, 1)]
        return out

    def trajectory_bytes(self, s: FastDLLMv2Settings, batch: int, prompt_length: int, steps: int) -> int:
        """Per forward (at most: the prefill, one per masked position of each block and its AR step; a block
        after the first starts with the AR token): x_steps and the note's canvas copy (int64), the note's
        kv_age (int64 per position) and masked / prompt / key_visible sets, the state's masked set and its
        key-visibility row (bool)."""
        bs, (first, n_blocks) = s.block_size, self._blocks(s, prompt_length)
        width = n_blocks * bs + 1
        forwards = int(prompt_length > bs)
        for b in range(first, n_blocks):
            lo, hi = b * bs, (b + 1) * bs
            given = max(prompt_length, lo + int(b > first or (prompt_length > bs and prompt_length % bs == 0)))
            forwards += max(hi - given, 0) + 1
        return forwards * (batch * width * (8 + 8 + 3 + 1) + width * (8 + 1))

    def logit_bytes(self, s: FastDLLMv2Settings, dtype_bytes: int) -> int:
        """Per sampled (sub-block) logit, `sample_with_top_p` (profiled, fp32 and bf16): the softmax at
        temperature 0; else the softmax, its sorted copy (+ int64 order), their cumulative sum and two boolean
        masks."""
        return dtype_bytes if s.temperature <= 0 else 3 * dtype_bytes + 8 + 2

    def row_logit_bytes(self, s: FastDLLMv2Settings, dtype_bytes: int) -> int:
        """The token-shifted copy `cat(raw[:, :1], raw[:, :-1])` of every row's logits."""
        return dtype_bytes

    def carried_bytes(self, s: FastDLLMv2Settings, dtype_bytes: int) -> tuple[int, int]:
        """The previous forward's raw logits and their shifted copy (the sub-block is a view of it) are still
        referenced while the next forward runs."""
        return 2 * dtype_bytes, 0

    def attention_extra_bytes(self, s: FastDLLMv2Settings, cfg: Any, batch: int,
                              extent: tuple[int, int, int, int], dtype_bytes: int) -> int:
        """A forward attending beyond its own rows concatenates the layer's cache with its rows' keys and values
        (`LayerKV` block / append): one layer's `[batch, keys, kv_heads·d_head]` k and v at a time (under
        append the concatenation becomes the cache and the old one is freed after it)."""
        q, keys = extent[0], extent[1]
        return 2 * batch * keys * cfg.n_key_value_heads * cfg.d_head * dtype_bytes if keys > q else 0
