"""A thin test-side adapter that lets diffusers' `LLaDA2Pipeline` (0.42) drive a `HookedMDM`.

What the pipeline asks of its model (`pipeline_llada2.py`): one call per refinement step,
`model(block_x, attention_mask=block_attn_mask, position_ids=block_position_ids).logits`, where `block_x` is the
canvas up to the active block's end (no KV cache), `position_ids` is `arange`, and `attention_mask` is a 2-D
`[batch, window]` int64 *padding* mask: 1 over the prompt (its tokenizer mask) and the `gen_length` answer slots,
0 over the block-aligned tail beyond `prompt_length + gen_length`. It builds no 4-D mask and no float mask (so no
bf16 cast either: the bf16 cast of the block mask belongs to dllm's own `generate`, not to diffusers), and it never
tells the model the block length: "the model handles backend-specific conversion internally".

Translation done here: the 2-D mask's zeros become keys no query sees — an explicit boolean `attn_mask`
`[batch, 1, query, key]`, ANDed by the HookedMDM with its block-causal mask (the HookedMDM's own HF-style
`attention_mask` cannot carry it: the hidden tail holds the mask token id, which it refuses as padding). Block-causal
attention comes from `block_length`, which the adapter holds because the pipeline does not pass it (a real
checkpoint would fix it in its config). `hide_tail=False` drops the padding mask
instead, i.e. every canvas slot is a visible key, as in dllm's `generate` — used to show that the hidden tail is
the whole difference there. Nothing else is added: no extra argument reaches the model, and an unexpected keyword
from the pipeline is an error rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AdapterOutput:
    logits: Tensor


class HookedMDMForDiffusers(torch.nn.Module):
    """`model(input_ids, attention_mask=..., position_ids=...).logits` over a HookedMDM with block-causal
    attention of `block_length`; `calls` records each forward's window length and whether its mask hid keys."""

    def __init__(self, model: torch.nn.Module, block_length: int, hide_tail: bool = True):
        super().__init__()
        self.model = model
        self.block_length = block_length
        self.hide_tail = hide_tail
        self.calls: list[tuple[int, bool]] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.model.W_E.dtype

    @property
    def device(self) -> torch.device:
        return self.model.W_E.device

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, **unexpected) -> AdapterOutput:
        if unexpected:
            raise TypeError(f"the pipeline passed arguments the adapter does not translate: {sorted(unexpected)}")
        if input_ids.shape[1] % self.block_length:
            raise ValueError(f"window {input_ids.shape[1]} is not whole blocks of {self.block_length}: the pipeline's "
                             "block_length and the adapter's differ")
        hides = attention_mask is not None and not bool(attention_mask.bool().all())
        self.calls.append((input_ids.shape[1], hides))
        keys = None
        if self.hide_tail and attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :].expand(-1, 1, input_ids.shape[1], -1)
        logits = self.model(input_ids, attn_mask=keys, position_ids=position_ids, block_length=self.block_length)
        return AdapterOutput(logits)
