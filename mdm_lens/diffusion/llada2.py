"""LLaDA2.x's sampler (`LLaDA2MoeModelLM.generate` of `modeling_llada2_moe.py`, as in ZHZisZZ/dllm @ ca176752),
step by step and observable: `generate(model, prompt, sampler="llada2", ...)`.

Blocks aligned at position 0 (`mdm_lens.diffusion.blockwise`). For each block from the one holding the prompt's
end: at most `steps` forwards over the canvas up to the block's end with the block-causal mask (no KV cache, as
there); each commits the block's masked positions whose sampled-token probability exceeds `threshold` when at
least the schedule's count (`get_num_transfer_tokens(block_length, steps)`) pass, else the count's most confident
ones (at most the masks left); a block with no mask left ends early. `steps = min(steps, gen_length //
minimal_topk)`. EOS handling, as in the reference:

* after every block, decoding stops once the generated part holds the EOS id (always, not only with
  `eos_early_stop`); later blocks stay masked in `out.tokens`;
* `eos_early_stop=True`: right after a step that commits EOS, the run stops if every position between the
  prompt and the first EOS is decoded;
* the reference returns the span up to and including the first EOS: `out.answer_length[0]` is its length
  (capped at gen_length; `out.texts` decodes that span), `out.tokens` keeps the whole canvas as decoded.

LLaDA2.1 (`editing_threshold=0.9`, the `generate()` of `modeling_llada21_moe.py` at the same commit): per block,
forwards until the block holds no mask and the last forward edited nothing, or `max_post_steps` forwards after
the block filled. Each forward commits the masks above `threshold` when at least `num_to_transfer` pass, else the
`num_to_transfer` most confident; and *edits* every decoded, non-prompt position of the block whose newly sampled
token differs with probability above `editing_threshold` (`state.extra["edited"]`; the trajectory's
`commit_step` holds a position's last write). `steps` plays no part there (as in that reference: refused when
given). Its EOS handling differs: no mid-block stop; with `eos_early_stop`, decoding stops after a block when the
generated part holds no mask and an EOS; the answer span ends at the first EOS, as in 2.0.

The reference runs in bf16 with its block mask cast to bf16; here the model's dtype applies (exact 0/-inf masks).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens import validate
from mdm_lens.diffusion.blockwise import (AlignedBlockSampler, BlockRecorder, block_length_for, end_step, layout,
                                          sample_tokens,
                                          transfer_schedule)
from mdm_lens.diffusion.arguments import ReferenceQuirkWarning
from mdm_lens.diffusion.canvas import Plan
from mdm_lens.diffusion.registry import SamplerSettings, register, resolved
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError, SamplerConfigError


@dataclass
class LLaDA2Settings(SamplerSettings):
    """`generate()`'s settings and defaults; `block_length` None = the checkpoint's (`cfg.extra["block_length"]`,
    32 unless its config names one); `eos_id` is the checkpoint's EOS (the reference's default is LLaDA2's id)."""

    steps: int | None = None  # per block; None: 32 (LLaDA2.0), unused by LLaDA2.1's editing loop
    gen_length: int = 2048
    block_length: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    eos_early_stop: bool = False
    minimal_topk: int = 1
    threshold: float = 0.95
    # LLaDA2.1's editing loop (None: LLaDA2.0's generate); then max_post_steps 16, num_to_transfer 1 by default
    editing_threshold: float | None = None
    max_post_steps: int | None = None
    num_to_transfer: int | None = None
    eos_id: int | None = resolved()

    def resolve(self, model: Any) -> "LLaDA2Settings":
        gen_length = validate.integer(self.gen_length, name="gen_length", min=1, error=SamplerConfigError)
        bl = block_length_for(model, self.block_length, 32, "llada2")
        block_length = validate.integer(bl, name="block_length", min=1, error=SamplerConfigError)
        edit = self.editing(block_length)
        if edit["editing_threshold"] is not None and self.steps is not None:
            raise SamplerConfigError(f"steps={self.steps!r}: LLaDA2.1's editing loop has no step schedule (it runs "
                                     "until each block is filled and stable); drop steps or editing_threshold.",
                                     argument="steps", value=self.steps, allowed="None with editing_threshold")
        if edit["editing_threshold"] is not None and self.minimal_topk != 1:
            raise SamplerConfigError(f"minimal_topk={self.minimal_topk!r} caps LLaDA2.0's steps; LLaDA2.1's editing "
                                     "loop has none (drop it or editing_threshold).", argument="minimal_topk",
                                     value=self.minimal_topk, allowed="1 with editing_threshold")
        steps = validate.integer(32 if self.steps is None else self.steps, name="steps", min=1,
                                 error=SamplerConfigError)
        minimal_topk = validate.integer(self.minimal_topk, name="minimal_topk", min=1, max=gen_length,
                                        error=SamplerConfigError)  # more: zero steps, nothing decoded
        top_k = None if self.top_k is None else validate.integer(self.top_k, name="top_k", max=model.cfg.d_vocab,
                                                                 error=SamplerConfigError)
        top_p = None if self.top_p is None else validate.number(self.top_p, name="top_p", min=0, min_open=True,
                                                                error=SamplerConfigError)
        eos_early_stop = validate.boolean(self.eos_early_stop, name="eos_early_stop")
        if self.steps is not None and steps > gen_length // minimal_topk:
            # the reference's cap, kept; a value the user chose is never lowered without a word
            warnings.warn(f"steps={steps} is lowered to {gen_length // minimal_topk} = gen_length ({gen_length}) // "
                          f"minimal_topk ({minimal_topk}), as the reference's generate caps it; out.settings['steps'] "
                          "shows the value used.", ReferenceQuirkWarning, stacklevel=5)
        if eos_early_stop and model.cfg.eos_token_id is None:
            raise SamplerConfigError("eos_early_stop=True but the model's EOS id is unknown (cfg.eos_token_id is "
                                     "None).", argument="eos_early_stop", value=True,
                                     allowed="a model with cfg.eos_token_id")
        return dataclasses.replace(
            self, steps=min(steps, gen_length // minimal_topk), gen_length=gen_length, block_length=block_length,
            temperature=validate.number(self.temperature, name="temperature", min=0, error=SamplerConfigError),
            top_p=top_p, top_k=top_k, eos_early_stop=eos_early_stop, minimal_topk=minimal_topk,
            threshold=validate.number(self.threshold, name="threshold", error=SamplerConfigError),
            eos_id=model.cfg.eos_token_id, **edit)

    def editing(self, block_length: int) -> dict[str, Any]:
        if self.editing_threshold is None:
            for name in ("max_post_steps", "num_to_transfer"):
                if getattr(self, name) is not None:
                    raise SamplerConfigError(f"{name}={getattr(self, name)!r} belongs to LLaDA2.1's editing loop; "
                                             "pass editing_threshold (e.g. 0.9) with it.", argument=name,
                                             value=getattr(self, name), allowed="None without editing_threshold")
            return dict(editing_threshold=None, max_post_steps=None, num_to_transfer=None)
        return dict(editing_threshold=validate.number(self.editing_threshold, name="editing_threshold",
                                                      error=SamplerConfigError),
                    max_post_steps=validate.integer(16 if self.max_post_steps is None else self.max_post_steps,
                                                    name="max_post_steps", min=0, error=SamplerConfigError),
                    num_to_transfer=validate.integer(1 if self.num_to_transfer is None else self.num_to_transfer,
                                                     name="num_to_transfer", min=1, max=block_length,
                                                     error=SamplerConfigError))


_EDITING = dict(active=lambda s: s.editing_threshold is not None, when="editing_threshold is set (LLaDA2.1's loop)",
                on={"editing_threshold": 0.9})
LLaDA2Settings.rules = {
    "steps": R.integer(1, none=True), "gen_length": R.integer(1), "block_length": R.integer(1, none=True),
    "temperature": R.number(0), **R.sampling_filters(),
    "eos_early_stop": R.boolean(), "minimal_topk": R.integer(1), "threshold": R.number(0, 1),
    "editing_threshold": R.number(0, 1, none=True), "max_post_steps": R.integer(0, none=True, **_EDITING),
    "num_to_transfer": R.integer(1, none=True, **_EDITING),
}

class LLaDA2Sampler(AlignedBlockSampler):
    name, Settings = "llada2", LLaDA2Settings
    # minimal_topk=1 caps steps at gen_length: LLaDA2's default, not a no-op elsewhere
    neutral = dict(eos_early_stop=False, top_p=None, top_k=None, editing_threshold=None,
                   max_post_steps=None, num_to_transfer=None)

    def block_plan(self, s: LLaDA2Settings, first: int, num_blocks: int) -> Plan:
        if s.editing_threshold is not None:  # masks fall by >= 1 per forward, then at most max_post_steps more
            return Plan((s.block_length + s.max_post_steps) * (num_blocks - first), num_blocks - first,
                        adaptive="LLaDA2.1 edits each block until it is filled and stable")
        return Plan(s.steps * (num_blocks - first), num_blocks - first,
                    adaptive="LLaDA2 ends a block when it holds no mask and stops at EOS")

    def check_prompt_ids(self, model: Any, ids: Tensor, s: LLaDA2Settings) -> None:
        if s.eos_early_stop and s.editing_threshold is None and bool((ids == s.eos_id).any()):
            raise InputError(f"the prompt contains the EOS id {s.eos_id}: with eos_early_stop=True the reference "
                             "finds it there and returns an empty answer. Remove it or drop eos_early_stop.",
                             argument="prompt", value=ids, allowed=f"token ids other than {s.eos_id}")

    def run(self, runner: Any, model: Any, x: Tensor, prompt_length: int, s: LLaDA2Settings, plan: Plan,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, BlockRecorder, list[int | None]]:
        if s.editing_threshold is not None:
            return llada21_sample(runner, model, x, prompt_length, s, plan, generator, bar)
        mask_id, bl, eos = model.cfg.mask_token_id, s.block_length, s.eos_id
        first, num_blocks, total = layout(prompt_length, s.gen_length, bl)
        n = prompt_length + s.gen_length
        recorder = BlockRecorder(n, prompt_length, x.device)
        prompt_index = torch.zeros_like(x, dtype=torch.bool)
        prompt_index[:, :prompt_length] = True
        key_visible = torch.ones_like(prompt_index)
        schedule = transfer_schedule(bl, s.steps)
        positions = torch.arange(total, device=x.device)[None]
        step = 0
        for nb in range(first, num_blocks):
            end = (nb + 1) * bl
            blk = slice(end - bl, end)
            for i in range(s.steps):
                active = x[:, blk] == mask_id
                if not bool(active.any()):
                    break
                state = DenoisingState(step, plan.n_steps, nb - first, plan.n_blocks, x.clone(), x == mask_id,
                                       prompt_index, key_visible, blk)
                state.computes(0, end).extra.update(kind="denoise", query_start=0, query_end=end, block_length=bl)
                logits = runner.forward(state, x[:, :end], position_ids=positions[:, :end], block_length=bl)
                x0, p = sample_tokens(logits[:, -bl:], s.temperature, s.top_k, s.top_p, generator)
                confidence = torch.where(active, p, torch.tensor(float("-inf"), dtype=p.dtype, device=p.device))
                transfer = torch.zeros_like(active)
                high = confidence[0] > s.threshold
                if int(high.sum()) >= schedule[i]:
                    transfer[0] = high
                else:
                    _, idx = torch.topk(confidence[0], k=min(schedule[i], int(active.sum())))
                    transfer[0, idx] = True
                block_x = x[:, blk]
                block_x[transfer] = x0[transfer]  # a view: writes the canvas
                end_step(runner, recorder, state, state.x, _full(transfer, blk, total),
                         _full(confidence, blk, total, float("-inf")), bar)
                step += 1
                if s.eos_early_stop and bool((x0[transfer] == eos).any()):
                    eos_pos = int((x[0] == eos).nonzero()[0, 0])
                    if bool((x[0, prompt_length:eos_pos] != mask_id).all()):
                        return x, recorder, [min(eos_pos + 1 - prompt_length, s.gen_length)]
            if eos is not None and bool((x[0, prompt_length:end] == eos).any()):
                break
        found = (x[0, prompt_length:n] == eos).nonzero() if eos is not None else x.new_zeros((0, 1))
        return x, recorder, [int(found[0, 0]) + 1 if len(found) else s.gen_length]


def llada21_sample(runner: Any, model: Any, x: Tensor, prompt_length: int, s: LLaDA2Settings, plan: Plan,
                   generator: torch.Generator | None, bar: Any) -> tuple[Tensor, BlockRecorder, list[int | None]]:
    """LLaDA2.1's loop (module docstring). `plan.n_steps` bounds the forwards: beyond it the model has been
    sampling the mask token itself, and the run stops with an error."""
    mask_id, bl, eos = model.cfg.mask_token_id, s.block_length, s.eos_id
    first, num_blocks, total = layout(prompt_length, s.gen_length, bl)
    n = prompt_length + s.gen_length
    recorder = BlockRecorder(n, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = torch.ones_like(prompt_index)
    positions = torch.arange(total, device=x.device)[None]
    neg_inf = torch.tensor(float("-inf"))
    step = 0
    for nb in range(first, num_blocks):
        end = (nb + 1) * bl
        blk = slice(end - bl, end)
        in_prompt = prompt_index[0, blk]
        post_steps = 0
        while True:
            old = x[:, blk].clone()
            active = old == mask_id
            if not bool(active.any()):
                post_steps += 1
            if post_steps > s.max_post_steps:
                break
            if step >= plan.n_steps:
                raise SamplerConfigError(f"block {nb - first} is still changing after {plan.n_steps} forwards: the "
                                         f"model keeps sampling the mask token {mask_id} itself. The reference's "
                                         "editing loop has no step bound (it would never end here), so the run is "
                                         "stopped; no setting bounds it (max_post_steps counts forwards after the "
                                         "block holds no mask). A trained model does not sample its mask token.",
                                         argument="editing_threshold", value=s.editing_threshold)
            state = DenoisingState(step, plan.n_steps, nb - first, plan.n_blocks, x.clone(), x == mask_id,
                                   prompt_index, key_visible, blk)
            state.computes(0, end).extra.update(kind="denoise", query_start=0, query_end=end, block_length=bl)
            logits = runner.forward(state, x[:, :end], position_ids=positions[:, :end], block_length=bl)
            x0, p = sample_tokens(logits[:, -bl:], s.temperature, s.top_k, s.top_p, generator)
            fill = torch.zeros_like(active)
            if bool(active.any()):
                confidence = torch.where(active, p, neg_inf.to(p))
                high = (confidence[0] > s.threshold) & active[0]
                if int(high.sum()) >= s.num_to_transfer:
                    fill[0] = high
                else:
                    _, idx = torch.topk(confidence[0], k=min(s.num_to_transfer, int(active.sum())))
                    fill[0, idx] = True
            editable = ~active & ~in_prompt[None]
            edit = (torch.where(editable, p, neg_inf.to(p)) > s.editing_threshold) & editable & (x0 != old)
            chosen = fill | edit
            block_x = x[:, blk]
            block_x[chosen] = x0[chosen]  # a view: writes the canvas
            state.extra["edited"] = _full(edit, blk, total)
            end_step(runner, recorder, state, state.x, _full(chosen, blk, total),
                     _full(torch.where(chosen, p, neg_inf.to(p)), blk, total, float("-inf")), bar)
            step += 1
            if not bool(active.any()) and not bool(edit.any()):
                break
        if s.eos_early_stop:
            generated = x[0, prompt_length:end]
            if not bool((generated == mask_id).any()) and bool((generated == eos).any()):
                break
    found = (x[0, prompt_length:n] == eos).nonzero() if eos is not None else x.new_zeros((0, 1))
    return x, recorder, [int(found[0, 0]) + 1 if len(found) else s.gen_length]


def _full(block: Tensor, blk: slice, total: int, fill: Any = False) -> Tensor:
    """A block's `[1, block]` tensor placed on the whole canvas `[1, total]`."""
    out = torch.full((block.shape[0], total), fill, dtype=block.dtype, device=block.device)
    out[:, blk] = block
    return out


register(LLaDA2Sampler())
