"""SDAR's sampler (`block_diffusion_generate` of JetAstra/SDAR `generate.py`), step by step and observable:
`generate(model, prompt, sampler="sdar", ...)`.

Blocks aligned at position 0 (`mdm_lens.diffusion.blockwise`) with an exact KV cache (`mdm_lens.kvcache`, modes
`append` / `block`): one forward over the prompt's whole blocks stores their keys/values (step 0, kind "prefill",
when the prompt fills a block); then per block, forwards over the block's rows attend to [cache; block] and commit
by `remasking_strategy`, and once the block holds no mask one more forward stores its keys/values (kind "store").
Every forward is a step; hooks on them see the rows they compute (`state.extra["query_start"/"query_end"]`).
After each block, decoding stops when the generated canvas holds one of `stopping_criteria_idx`.

Strategies, with `schedule = get_num_transfer_tokens(block_length, steps)` per step:
* `low_confidence_dynamic`: the masked positions above `confidence_threshold` when at least the step's count pass,
  else the count's most confident positions;
* `low_confidence_static`: the count's most confident positions;
* `sequential`: the count's positions from the first mask on;
* `entropy_bounded`: positions in ascending "entropy", the count before the cumulative sum reaches
  `eb_threshold` (at least 1, at most the masks left).

Reference quirks, reproduced (the defaults) or refused:
* `entropy_bounded` sums -p log p of the *sampled tokens' probabilities over the block axis*, one value for the
  whole block, so every masked position ties and `torch.sort`'s order picks them; reproduced. Its branch never
  creates `transfer_index` (the reference raises UnboundLocalError at its first step): here it starts empty.
* a topk count larger than the masks left (a partly-prompt first block, or earlier steps that committed more
  than their count) selects -inf positions too, rewriting prompt or decoded tokens with this step's sample;
  reproduced (the trajectory shows the rewrite), and said at the end of the run (`ReferenceQuirkWarning` naming the
  steps and positions: prompt tokens change `out.tokens[:, :prompt_length]`).
* temperature 0 divides the logits by zero and `torch.multinomial` fails: refused (use a small temperature).
* a block still masked after `steps` steps (the model sampled the mask token) makes the reference index past its
  schedule: refused with an error at that step.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.arguments import ReferenceQuirkWarning
from mdm_lens import validate
from mdm_lens.diffusion.blockwise import (AlignedBlockSampler, BlockRecorder, block_length_for, end_step, layout,
                                          sample_tokens,
                                          transfer_schedule)
from mdm_lens.diffusion.canvas import Plan
from mdm_lens.diffusion.llada2 import _full
from mdm_lens.diffusion.registry import SamplerSettings, register
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError
from mdm_lens.kvcache import KVCache

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded")


@dataclass
class SDARSettings(SamplerSettings):
    """`block_diffusion_generate`'s settings and defaults; `block_length` None = the checkpoint's
    (`cfg.extra["block_length"]`, the CLI's 4); `steps` (the reference's `denoising_steps`) None = block_length
    (the CLI pairs 4 with 4, the function 8 with 8)."""

    steps: int | None = None
    gen_length: int = 128
    block_length: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    remasking_strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    eb_threshold: float | None = None
    stopping_criteria_idx: tuple[int, ...] | None = None

    def resolve(self, model: Any) -> "SDARSettings":
        gen_length = validate.integer(self.gen_length, name="gen_length", min=1, error=SamplerConfigError)
        bl = block_length_for(model, self.block_length, 4, "sdar")
        block_length = validate.integer(bl, name="block_length", min=1, error=SamplerConfigError)
        steps = validate.integer(block_length if self.steps is None else self.steps, name="steps", min=1,
                                 error=SamplerConfigError)
        temperature = validate.number(self.temperature, name="temperature", min=0, min_open=True,
                                      error=SamplerConfigError)  # 0: the reference divides by zero
        strategy = validate.choice(self.remasking_strategy, STRATEGIES, name="remasking_strategy",
                                   error=SamplerConfigError)
        eb = self.eb_threshold
        if strategy == "entropy_bounded" and eb is None:
            raise SamplerConfigError("remasking_strategy='entropy_bounded' needs eb_threshold (the reference fails "
                                     "without one; its command line uses 0.35).", argument="eb_threshold",
                                     value=None, allowed="a number, e.g. 0.35")
        stop = self.stopping_criteria_idx
        if stop is not None:
            stop = tuple(validate.integer(t, name="stopping_criteria_idx", min=0, max=model.cfg.d_vocab - 1,
                                          error=SamplerConfigError)
                         for t in ([stop] if isinstance(stop, (int, str)) else stop))  # "62" is one (bad) id
            validate.distinct_ids({"cfg.mask_token_id": model.cfg.mask_token_id,
                                   **{f"stopping_criteria_idx[{j}]": t for j, t in enumerate(stop)}},
                                  why="the mask id fills every position not yet decoded, so the first stop check "
                                      "would end the run with masks in the answer.", error=SamplerConfigError)
        return dataclasses.replace(
            self, steps=steps, gen_length=gen_length, block_length=block_length, temperature=temperature,
            top_k=validate.integer(self.top_k, name="top_k", max=model.cfg.d_vocab, error=SamplerConfigError),
            top_p=validate.number(self.top_p, name="top_p", min=0, min_open=True, error=SamplerConfigError),
            remasking_strategy=strategy,
            confidence_threshold=validate.number(self.confidence_threshold, name="confidence_threshold",
                                                 error=SamplerConfigError),
            eb_threshold=None if eb is None else validate.number(eb, name="eb_threshold", error=SamplerConfigError),
            stopping_criteria_idx=stop)


SDARSettings.rules = {
    "steps": R.integer(1, none=True), "gen_length": R.integer(1), "block_length": R.integer(1, none=True),
    "temperature": R.number(0, low_open=True), "top_k": R.integer(0), "top_p": R.number(0, 1, low_open=True),
    "remasking_strategy": R.choice(STRATEGIES),
    "confidence_threshold": R.number(0, 1, active=lambda s: s.remasking_strategy == "low_confidence_dynamic",
                                     when="remasking_strategy='low_confidence_dynamic'",
                                     off={"remasking_strategy": "low_confidence_static"}),
    "eb_threshold": R.number(0, none=True, active=lambda s: s.remasking_strategy == "entropy_bounded",
                             when="remasking_strategy='entropy_bounded'", on={"remasking_strategy": "entropy_bounded"}),
    "stopping_criteria_idx": R.anything("a token id or a tuple of them (checked against the vocabulary by resolve)"),
}

def transfer(strategy: str, mask_index: Tensor, x0_p: Tensor, count: int, confidence_threshold: float,
             eb_threshold: float | None) -> Tensor:
    """The reference's transfer index for one step over a block `[1, block]`."""
    out = torch.zeros_like(mask_index)
    neg_inf = torch.tensor(float("-inf"), dtype=x0_p.dtype, device=x0_p.device)
    if strategy == "sequential":
        start = int(mask_index[0].nonzero()[0, 0])
        out[0, start:start + count] = True
    elif strategy == "low_confidence_static":
        out[0, torch.topk(torch.where(mask_index, x0_p, neg_inf)[0], count).indices] = True
    elif strategy == "low_confidence_dynamic":
        confidence = torch.where(mask_index, x0_p, neg_inf)[0]
        high = confidence > confidence_threshold
        if int(high.sum()) >= count:
            out[0] = high
        else:
            out[0, torch.topk(confidence, count).indices] = True
    else:  # entropy_bounded, with the reference's sum over the block axis
        p = x0_p.clamp_min(1e-12)
        entropies = torch.where(mask_index, -(p * p.log()).sum(dim=-1), torch.inf)
        ranked, order = torch.sort(entropies, dim=1, descending=False)
        cumsum = torch.cumsum(ranked, dim=1)
        k = int(torch.searchsorted(cumsum[0], torch.tensor(eb_threshold, device=x0_p.device), right=False))
        k = max(1, min(k, int(mask_index[0].sum())))
        out[0, order[0, :k]] = True
    return out


class SDARSampler(AlignedBlockSampler):
    name, Settings = "sdar", SDARSettings
    neutral = dict(stopping_criteria_idx=None)  # remasking_strategy selects SDAR's algorithm: never a no-op
    renamed = dict(denoising_steps="steps")

    def block_plan(self, s: SDARSettings, first: int, num_blocks: int) -> Plan:
        prefill = 1 if first > 0 else 0
        return Plan(prefill + (s.steps + 1) * (num_blocks - first), num_blocks - first,
                    adaptive="SDAR ends a block when it holds no mask and stops at a stopping token")

    note_bytes = 16  # the forward's canvas copy and its KV cache's ages (`kv_age`), int64 per position

    def forward_extents(self, s: SDARSettings, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """The prompt's whole blocks in one prefill forward (its logits unsampled; the cache grows to it), then one
        block's rows at a time against the cache, which ends up spanning the block-rounded canvas."""
        first, _, total = layout(prompt_length, s.gen_length, s.block_length)
        bl, prefill = s.block_length, first * s.block_length
        return [(prefill, prefill, prefill, 0), (bl, total, total, bl)] if first else [(bl, total, total, bl)]

    def check_run(self, ids: Tensor, am: Tensor, s: SDARSettings, obs: Any) -> None:
        from mdm_lens.hooks.reducers import ReceivedAttention, TopKKeys

        # TopKKeys follows a cached forward (query rows from state.extra["query_start"], keys = the cached finished
        # blocks + the block, absolute positions), so retrieval's records are what SDAR's forwards saw
        other = [r for r in obs.record if not isinstance(r, (ReceivedAttention, TopKKeys))]
        if other:
            raise SamplerConfigError(f"record={[type(r).__name__ for r in other]} on an SDAR run: these reducers "
                                     "place rows at positions 0.. and SDAR's cached forwards compute one block's "
                                     "rows; ReceivedAttention, TopKKeys (over the block's query rows), cache= and "
                                     "fwd_hooks work.", argument="record", value=obs.record,
                                     allowed="ReceivedAttention, TopKKeys")

    def run(self, runner: Any, model: Any, x: Tensor, prompt_length: int, s: SDARSettings, plan: Plan,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, BlockRecorder, list[int | None]]:
        mask_id, bl = model.cfg.mask_token_id, s.block_length
        first, num_blocks, total = layout(prompt_length, s.gen_length, bl)
        recorder = BlockRecorder(prompt_length + s.gen_length, prompt_length, x.device)
        prompt_index = torch.zeros_like(x, dtype=torch.bool)
        prompt_index[:, :prompt_length] = True
        key_visible = torch.ones_like(prompt_index)
        positions = torch.arange(total, device=x.device)[None]
        cache = KVCache(model, total)
        schedule = transfer_schedule(bl, s.steps)
        no_commit = torch.zeros_like(prompt_index)
        rewritten: list[tuple[int, int]] = []  # (step, position) of unmasked positions a step overwrote
        step = 0

        def forward(kind: str, lo: int, hi: int, block: int, blk: slice) -> tuple[DenoisingState, Tensor]:
            cache.computed(lo, hi, step)
            state = DenoisingState(step, plan.n_steps, block, plan.n_blocks, x.clone(), x == mask_id, prompt_index,
                                   key_visible, blk)
            state.computes(lo, hi).extra.update(kind=kind, query_start=lo, query_end=hi, kv_age=cache.age.clone(),
                                              block_length=bl)
            with cache.attached("block" if kind == "denoise" else "append"):
                logits = runner.forward(state, x[:, lo:hi], position_ids=positions[:, lo:hi], block_length=bl)
            return state, logits

        if first > 0:
            state, _ = forward("prefill", 0, first * bl, 0, slice(0, first * bl))
            end_step(runner, recorder, state, state.x, no_commit, None, bar)
            step += 1
        for nb in range(first, num_blocks):
            lo, hi = nb * bl, (nb + 1) * bl
            blk = slice(lo, hi)
            for i in range(s.steps + 1):
                mask_index = x[:, blk] == mask_id
                if not bool(mask_index.any()):
                    state, _ = forward("store", lo, hi, nb - first, blk)
                    end_step(runner, recorder, state, state.x, no_commit, None, bar)
                    step += 1
                    break
                if i == s.steps:
                    raise SamplerConfigError(f"block {nb - first} still holds mask tokens after its {s.steps} steps: "
                                             f"the model sampled the mask token {mask_id} itself (the reference "
                                             "indexes past its schedule here).", argument="steps", value=s.steps)
                state, logits = forward("denoise", lo, hi, nb - first, blk)
                x0, x0_p = sample_tokens(logits, s.temperature, s.top_k, s.top_p, generator)
                chosen = transfer(s.remasking_strategy, mask_index, x0_p, schedule[i], s.confidence_threshold,
                                  s.eb_threshold)
                rewritten.extend((step, lo + int(j)) for j in (chosen & ~mask_index)[0].nonzero()[:, 0])
                block_x = x[:, blk]
                block_x[chosen] = x0[chosen]  # a view: writes the canvas
                confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype))
                end_step(runner, recorder, state, state.x, _full(chosen, blk, total),
                         _full(confidence, blk, total, float("-inf")), bar)
                step += 1
            stop = s.stopping_criteria_idx
            if stop is not None and any(bool((x[:, prompt_length:] == t).any()) for t in stop):
                # the answer ends at its first stop token (inclusive, as LLaDA2's EOS): the blocks after it never
                # ran and keep the mask id, which the answer span must not include
                hit = torch.isin(x[0, prompt_length:], torch.tensor(stop, device=x.device)).nonzero()
                _warn_rewritten(rewritten, prompt_length)
                return x, recorder, [int(hit[0, 0]) + 1]
        _warn_rewritten(rewritten, prompt_length)
        return x, recorder, [None]


def _warn_rewritten(rewritten: list[tuple[int, int]], prompt_length: int) -> None:
    """Say when the reference quirk (a step's topk count above the masks left) overwrote tokens that were not masked:
    prompt tokens change `out.tokens[:, :prompt_length]`."""
    if not rewritten:
        return
    prompt = sorted({p for _, p in rewritten if p < prompt_length})
    warnings.warn(f"sampler='sdar' rewrote {len(rewritten)} unmasked position(s) (steps, positions: {rewritten[:8]}"
                  f"{' …' if len(rewritten) > 8 else ''}), {len(prompt)} of them prompt tokens {prompt[:8]}: a step's "
                  "transfer count exceeded the masks left in its block (a block the prompt partly fills, with fewer "
                  "steps than its length), so the reference's topk picked unmasked positions; reproduced. Give "
                  "steps that divide the masked count, or a prompt that ends at a block boundary, to avoid it.",
                  ReferenceQuirkWarning, stacklevel=4)


register(SDARSampler())
