"""Fast-dLLM v2's sampler (`Fast_dLLM_QwenForCausalLM.batch_sample`, NikhilSDate/Fast-dLLM `v2/generation_functions.py`
@ 734a60d4), step by step and observable: `generate(model, prompts, sampler="fastdllm_v2", ...)`.

Blocks of `block_size` aligned at position 0, each split into sub-blocks of `small_block_size` decoded in order.
A forward over the shortest prompt's whole blocks fills the KV cache (kind "prefill", when it is longer than a
block); per block, forwards over the block's rows (kind "denoise") attend to [cache; block], logits token-shifted
(`cat(raw[:1], raw[:-1])`); per sub-block, every masked position whose probability exceeds `threshold` is committed,
always the most confident one (`factor=True`: the reference's factor rule). Once the block holds no mask, one more
forward (kind "ar") stores its keys/values and its last raw logit's argmax is the next block's first token. Every
forward is a step; hooks see the rows it computes (`state.extra["query_start"/"query_end"]`, the forward's block mask
`["block_length"]`; `use_block_cache=True`: a sub-block forward computes the sub-block's rows, written into the
block's cache, `state.extra["block_cache"]` "fill"/"window"). `state.block` counts decoded blocks, `state.extra["sub_block"]` the sub-block,
`state.extra["active_rows"]` the rows the reference still decodes.

A batch of prompts of different lengths runs as the reference does: right-padded with the mask id, decoding from
the shortest prompt's block on. A row stops when it commits `stop_token`: once its block is full, every token after
its first stop token becomes `pad_id` and the row leaves the batch (here it stays in the forwards, frozen and
filled with `pad_id`: rows never interact). `out.tokens` is each row as the reference returns it (prompt,
generated tokens, pads after the stop token, the next block's first token when the AR forward ran) in its
right-padded layout; `out.prompt_length` is the shortest prompt, `out.settings["prompt_lengths"]` each row's,
`out.attention_mask` is 0 past a row's returned length.

Quirks reproduced: `max_new_tokens` is floored to whole blocks (warned); a prompt of exactly `block_size` tokens is never read (no prefill, decoding starts at block 1;
warned); a stop token emitted by the AR step does not stop the row; a batch whose longest prompt is one token past
a block end loses that token to the AR prediction (warned); a longer prompt ending at a block end while shorter rows
generate gets no AR token (its first position is denoised from its own logit). Refused (the reference fails or
loops forever): `block_size` not a multiple of `small_block_size`; `max_new_tokens < block_size`; a block size not
dividing 32 (its denoising forwards pass no `block_size`: the model masks over 32-token blocks); temperature > 0
with several rows (`torch.multinomial(p[0])` samples row 0's distribution for all); a greedy step that changes
nothing (the model's top token is the mask id).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens import tokenization, validate
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion.canvas import CanvasSampler, Plan
from mdm_lens.diffusion.output import GenerateOutput, Trajectory, TrajectoryRecorder, model_key
from mdm_lens.diffusion.registry import Observation, SamplerSettings, progress_bar, register
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner, check_logits
from mdm_lens.kvcache import KVCache, LayerKV
from mdm_lens.loading.fastdllm_v2 import BD_SIZE, STOP_TOKEN

from mdm_lens.diffusion.fastdllm_v2_settings import REFERENCE_MASK_BLOCK, FastDLLMv2Settings  # noqa: F401
from mdm_lens.diffusion.fastdllm_v2_memory import FastDLLMv2Memory


def sample_with_top_p(logits: Tensor, top_p: float, temperature: float,
                      generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The reference's `sample_with_top_p`: greedy argmax of the softmax at temperature 0, else a nucleus-filtered,
    renormalised distribution and one draw per position of row 0 (the caller refuses more rows)."""
    if temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(dim=-1), probs
    probs = F.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = torch.cumsum(sorted_probs, dim=-1) > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    token = torch.multinomial(probs[0].cpu(), 1, generator=generator).to(probs.device)
    return token.view(1, -1), probs


def factor_unmask(x1_p: Tensor, masked: Tensor, factor_value: float) -> Tensor:
    """The reference's `get_factor_unmask_idx`: per row, walk the masked confidences in descending order while the
    n-th (1-based, n >= 2) is at least `1 - factor_value / (n + 1)`; the first always passes, and a walk that stops
    at the last one (or has one only) takes one more — every masked position then, the quirk kept."""
    out = torch.zeros_like(masked)
    for j in range(x1_p.shape[0]):
        n_masked = int(masked[j].sum())
        if n_masked == 0:
            continue
        ranked = x1_p[j][masked[j]].sort(descending=True).values
        stop = 0
        for stop in range(n_masked):
            bar = -1.0 if stop == 0 else 1.0 - factor_value / (stop + 2)
            if ranked[stop].item() < bar:
                break
        if stop == 0 or stop == n_masked - 1:
            stop += 1
        out[j, torch.topk(x1_p[j], k=stop).indices] = True
    return out & masked


class SubBlockKV(LayerKV):
    """`LayerKV` plus the reference's block cache (`use_block_cache`): `block_fill` attends to [cache; block] and
    keeps the block's keys/values aside; `block_window` writes a sub-block's fresh rows into them (its
    `replace_position`) and attends to [cache; block cache]."""

    def __init__(self) -> None:
        super().__init__()
        self.block_k: Tensor | None = None
        self.block_v: Tensor | None = None

    def __call__(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.mode == "block_fill":
            self.block_k, self.block_v = k.clone(), v.clone()
            self.mode = "block"
            try:
                return super().__call__(k, v)
            finally:
                self.mode = "block_fill"
        if self.mode == "block_window":
            start, end = self.window  # type: ignore[misc]
            self.block_k[:, start:end] = k  # type: ignore[index]
            self.block_v[:, start:end] = v  # type: ignore[index]
            k, v = self.block_k, self.block_v  # type: ignore[assignment]
            if self.k is not None and self.v is not None:
                k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
            return k, v
        return super().__call__(k, v)


class FastDLLMv2Sampler(FastDLLMv2Memory, CanvasSampler):
    name, Settings = "fastdllm_v2", FastDLLMv2Settings
    neutral = dict(use_block_cache=False, factor=False)
    # the other samplers' names of the same ideas (the reference's names are kept here)
    renamed = {"gen_length": "max_new_tokens", "block_length": "block_size", "pad_token_id": "pad_id"}

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        if value is None and option in ("threshold", "factor", "top_p"):  # "off" as the other samplers spell it
            return True
        if option == "top_p" and value == 1.0:  # keeps every token
            return True
        return super().is_neutral(option, value, given)

    def plan(self, s: FastDLLMv2Settings, lengths: list[int] | None = None) -> Plan:
        """The most forwards a run can make: the prefill, then per block one per masked position and the AR step
        (prompt lengths unknown: one prompt shorter than a block)."""
        bs = s.block_size
        lengths = lengths or [1]
        first, num_blocks = min(lengths) // bs, s.max_new_tokens // bs + max(lengths) // bs
        prefill = 1 if min(lengths) > bs else 0
        return Plan(prefill + (bs + 1) * (num_blocks - first), num_blocks - first,
                    adaptive="Fast-dLLM v2 commits by confidence and stops at the stop token")

    def check_model(self, model: Any) -> None:
        super().check_model(model)
        if not model.cfg.logit_shift:
            raise SamplerConfigError(f"sampler='fastdllm_v2' reads token-shifted logits; {model.cfg.model_name} is "
                                     "not a token-shift model (load a Fast-dLLM v2 checkpoint).", argument="sampler",
                                     value=self.name, allowed="a Fast-dLLM v2 model")

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: FastDLLMv2Settings, obs: Observation) -> None:
        lengths = am.sum(dim=1).tolist()
        if not bool((am == (torch.arange(am.shape[1], device=am.device) >= am.shape[1] - am.sum(1, keepdim=True))
                     .to(am.dtype)).all()):
            raise InputError("attention_mask must be left padding (0s then 1s per row).", argument="attention_mask",
                             value=am, allowed="left-padded rows")
        if bool((ids[am.bool()] == model.cfg.mask_token_id).any()):
            raise InputError(f"the prompt contains the mask token {model.cfg.mask_token_id}.", argument="prompt",
                             value=ids, allowed="token ids other than the mask id")
        if s.temperature > 0 and ids.shape[0] > 1:
            raise SamplerConfigError("temperature > 0 with a batch: the reference's sample_with_top_p draws from row "
                                     "0's distribution and writes those tokens into every row; decode rows one at a "
                                     "time.", argument="temperature", value=s.temperature, allowed="0 for a batch")
        from mdm_lens.hooks.reducers import ReceivedAttention

        other = [r for r in obs.record if not isinstance(r, ReceivedAttention)]
        if other:
            raise SamplerConfigError(f"record={[type(r).__name__ for r in other]} on a Fast-dLLM v2 run: these reducers "
                                     "place rows at positions 0.. and its cached forwards compute one block's (or "
                                     "sub-block's) rows; ReceivedAttention, cache= and fwd_hooks work.",
                                     argument="record", value=obs.record, allowed="ReceivedAttention only")
        bs = s.block_size
        num_blocks = s.max_new_tokens // bs + max(lengths) // bs
        width = num_blocks * bs + 1
        if width > model.cfg.n_ctx:
            raise SamplerConfigError(f"the canvas runs to {width} positions (max_new_tokens {s.max_new_tokens} in "
                                     f"blocks of {bs} after the longest prompt), beyond the context of "
                                     f"{model.cfg.n_ctx}.", argument="max_new_tokens", value=s.max_new_tokens,
                                     allowed=f"a canvas of at most {model.cfg.n_ctx} positions")

    def generate(self, model: Any, prompt: Any, s: FastDLLMv2Settings, obs: Observation) -> GenerateOutput:
        ids, am = arguments.prompt_tokens(model, prompt, obs.attention_mask)
        self.check_inputs(model, ids, am, s, obs)
        lengths, bs = am.sum(dim=1).tolist(), s.block_size
        width = (s.max_new_tokens // bs + max(lengths) // bs) * bs + 1
        if min(lengths) == bs:
            warnings.warn(f"the shortest prompt has exactly block_size={bs} tokens: the reference never reads its "
                          "first block (no prefill for a prompt not longer than a block; decoding starts at block "
                          "1). Reproduced.", stacklevel=4)
        if s.max_new_tokens % bs:
            warnings.warn(f"max_new_tokens={s.max_new_tokens} is not a multiple of block_size={bs}: the reference "
                          f"budgets max_new_tokens // block_size = {s.max_new_tokens // bs} block(s) past the prompt's, "
                          f"so the last {s.max_new_tokens % bs} requested token(s) are never generated. Reproduced; "
                          "pass a multiple of block_size.", arguments.ReferenceQuirkWarning, stacklevel=4)
        x = torch.full((ids.shape[0], width), model.cfg.mask_token_id, dtype=torch.long, device=ids.device)
        for r, n in enumerate(lengths):
            x[r, :n] = ids[r, ids.shape[1] - n:]
        runner = StepRunner(model, fwd_hooks=obs.fwd_hooks, hook_steps=obs.hook_steps, record=obs.record,
                            cache=obs.cache)
        plan = self.plan(s, lengths)
        runner.refuse_end_relative(plan.adaptive or "")
        runner.begin(x.shape[0], width, plan.n_steps, n_blocks=plan.n_blocks, phases=plan.phases)
        generator = torch.Generator().manual_seed(obs.seed) if obs.seed is not None else None
        bar = progress_bar(obs.progress, plan.n_steps, f"{self.name} sampling")
        try:
            with torch.no_grad():
                loop = _Loop(runner, model, x, lengths, s, plan, generator, bar)
                returned = loop.run()
        finally:
            if bar is not None:
                bar.close()
        runner.warn_unreached(len(loop.recorder.x_steps))
        records, meta = runner.records()
        end = max(returned)
        tokens = loop.x[:, :end]
        keep = torch.arange(end, device=x.device)[None] < torch.tensor(returned, device=x.device)[:, None]
        trajectory = loop.recorder.finish()
        trajectory = dataclasses.replace(trajectory, x_steps=trajectory.x_steps[:, :, :end], commit_step=trajectory
                                         .commit_step[:, :end], commit_confidence=trajectory.commit_confidence[:, :end])
        texts = None
        if model.tokenizer is not None:
            texts = [tokenization.decode(model.tokenizer, row[n:stop].tolist(), skip_special_tokens=True)
                     for row, n, stop in zip(tokens.cpu(), lengths, returned)]
        # kv_cache: the block cache is exact (replayed); use_block_cache's sub-block forwards read stale rows (refused)
        settings = dict(s.as_dict(), seed=obs.seed, mask_id=model.cfg.mask_token_id, prompt_lengths=lengths,
                        kv_cache="block+sub_block" if s.use_block_cache else "block",
                        returned_lengths=returned, n_forwards=len(loop.recorder.x_steps))
        p = min(lengths)
        return GenerateOutput(tokens=tokens, prompt_length=p, attention_mask=keep.long(), trajectory=trajectory,
                              sampler=self.name, settings=settings, causal=False, records=records, record_meta=meta,
                              cache=runner.cache, model_name=model.cfg.model_name, texts=texts,
                              model_key=model_key(model), answer_length=[n - p for n in returned])


class _Loop:
    """One `batch_sample` run over a fixed-width canvas `x` (see the module docstring)."""

    def __init__(self, runner: StepRunner, model: Any, x: Tensor, lengths: list[int], s: FastDLLMv2Settings,
                 plan: Plan, generator: torch.Generator | None, bar: Any):
        self.runner, self.model, self.x, self.s, self.plan = runner, model, x, s, plan
        self.generator, self.bar = generator, bar
        self.mask_id = model.cfg.mask_token_id
        batch, total = x.shape
        self.seq_len = torch.tensor(lengths, device=x.device)
        self.positions = torch.arange(total, device=x.device)[None]
        self.prompt = self.positions < self.seq_len[:, None]
        self.cache = KVCache(model, total)
        self.cache.layers = [SubBlockKV() for _ in model.blocks]
        self.recorder = TrajectoryRecorder(batch, total, 0, x.device)
        self.recorder.commit_step[self.prompt.cpu()] = -1
        self.active = torch.ones(batch, dtype=torch.bool, device=x.device)
        self.finished = torch.zeros_like(self.active)
        self.step, self.first = 0, min(lengths) // s.block_size

    def forward(self, kind: str, lo: int, hi: int, block: int, blk: slice, mode: str,
                window: tuple[int, int] | None = None, sub: int | None = None) -> tuple[DenoisingState, Tensor]:
        """One hooked forward over canvas rows [lo, hi); returns it and its raw logits."""
        if self.step >= self.plan.n_steps:
            raise SamplerConfigError(f"the run passed its bound of {self.plan.n_steps} forwards: the model keeps "
                                     f"sampling the mask token {self.mask_id}.", argument="temperature",
                                     value=self.s.temperature)
        self.cache.computed(lo, hi, self.step)
        x = self.x
        state = DenoisingState(self.step, self.plan.n_steps, block, self.plan.n_blocks, x.clone(),
                               (x == self.mask_id) & (self.positions < blk.stop), self.prompt,
                               (self.positions < (blk.stop if mode == "block_window" else hi)).expand_as(x), blk)
        state.computes(lo, hi, blk.stop if mode == "block_window" else hi).extra.update(
            kind=kind, query_start=lo, query_end=hi, block_length=self.s.block_size, kv_age=self.cache.age.clone(),
            sub_block=sub, active_rows=self.active.clone(), unknown_length=self.runner.unknown_length,
            block_cache={"block_fill": "fill", "block_window": "window"}.get(mode))
        self.runner.model.state = state
        hooks = self.runner._hooks_for(state)
        try:
            with self.cache.attached(mode, window), self.model.hooks(fwd_hooks=hooks):
                raw = self.model(x[:, lo:hi], position_ids=self.positions[:, lo:hi],
                                 block_length=self.s.block_size)
        finally:
            self.model.state = None
        check_logits(raw, state)
        return state, raw

    def end(self, state: DenoisingState, committed: Tensor, confidence: Tensor | None) -> None:
        state.committed = committed
        state.confidence = None if confidence is None else confidence.float()
        self.runner.end_step(state)
        self.recorder.record(state.step, state.block, state.x, committed, confidence, state=state)
        if self.bar is not None:
            self.bar.update(1)
        self.step += 1

    def run(self) -> list[int]:
        s, x, bs = self.s, self.x, self.s.block_size
        min_len, max_len = int(self.seq_len.min()), int(self.seq_len.max())
        num_blocks = s.max_new_tokens // bs + max_len // bs
        self.width = max_len  # the reference's `input_ids` width
        returned = [0] * x.shape[0]
        if min_len > bs:
            k = min_len // bs * bs
            state, raw = self.forward("prefill", 0, k, 0, slice(0, k), "append")
            committed = torch.zeros_like(x, dtype=torch.bool)
            if min_len % bs == 0:
                rows = self.seq_len == min_len
                x[rows, min_len] = raw[rows, -1].argmax(dim=-1)
                committed[rows, min_len] = True
                self.width = max(self.width, min_len + 1)
            del raw  # the prompt's logits [batch, k, vocab] would otherwise live through every block's forwards
            self.end(state, committed, None)
        sbi = self.seq_len // bs
        xt_width = self.width
        for b in range(self.first, num_blocks):
            if not bool(self.active.any()):
                break
            if bool((sbi[self.active] == b).all()):
                self.width = (b + 1) * bs
            xt_width = self._block(b, sbi)
            sbi[sbi == b] = b + 1
            done = self.active & self.finished
            for r in done.nonzero().flatten().tolist():
                returned[r] = xt_width
                x[r, xt_width:] = s.pad_id  # the row leaves the batch: inert from here on
            self.active &= ~done
            self.finished &= self.active
        for r in self.active.nonzero().flatten().tolist():
            returned[r] = xt_width
        return returned

    def _block(self, b: int, sbi: Tensor) -> int:
        """Decode block b; returns the width of the reference's `x_t` after it."""
        s, x, bs, mask_id = self.s, self.x, self.s.block_size, self.mask_id
        lo, hi = b * bs, (b + 1) * bs
        blk, block = slice(lo, hi), b - self.first
        block_cached = False
        while True:
            if not bool((x[:, blk] == mask_id).any()):
                for r in (self.finished & self.active).nonzero().flatten().tolist():
                    n = int(self.seq_len[r])
                    first_stop = int((x[r, n:hi] == s.stop_token).nonzero()[0, 0])
                    x[r, n + first_stop + 1:hi] = s.pad_id
                if bool(self.finished[self.active].all()):
                    return hi
                state, raw = self.forward("ar", lo, hi, block, blk, "append")
                token = raw[:, -1].argmax(dim=-1)
                token[self.finished] = s.pad_id
                rows = self.active & (sbi == b) if self.width > hi + 1 else self.active
                if self.width == hi + 1 and bool((rows & (self.seq_len > hi)).any()):
                    warnings.warn(f"block {b}: the reference overwrites the last prompt token (position {hi}) of the "
                                  "longest prompt(s) with the AR prediction (its input_ids and x_t have the same "
                                  "width). Reproduced.", stacklevel=6)
                if self.width <= hi + 1:
                    self.width = hi + 1
                committed = torch.zeros_like(x, dtype=torch.bool)
                committed[rows, hi] = x[rows, hi] == mask_id
                x[rows, hi] = token[rows]
                self.end(state, committed, None)
                return hi + 1
            for j in range(bs // s.small_block_size):
                s0, s1 = j * s.small_block_size, (j + 1) * s.small_block_size
                sub = slice(lo + s0, lo + s1)
                while True:
                    masked = x[:, sub] == mask_id
                    if not bool(masked.any()):
                        break
                    if s.use_block_cache and block_cached and not bool((x[:, lo + s0] == mask_id).any()):
                        state, raw = self.forward("denoise", lo + s0, lo + s1, block, blk, "block_window",
                                                  (s0, s1), j)
                        logits = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
                    else:
                        mode = "block_fill" if s.use_block_cache else "block"
                        state, raw = self.forward("denoise", lo, hi, block, blk, mode, None, j)
                        block_cached = s.use_block_cache
                        logits = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)[:, s0:s1]
                    self._commit(state, logits, masked, sub)

    def _commit(self, state: DenoisingState, logits: Tensor, masked: Tensor, sub: slice) -> None:
        s, x = self.s, self.x
        x_1, p_1t = sample_with_top_p(logits, s.top_p, s.temperature, self.generator)
        x1_p = torch.gather(p_1t, -1, x_1.expand(masked.shape[0], -1).unsqueeze(-1)).squeeze(-1)
        x1_p = torch.where(masked, x1_p, torch.tensor(float("-inf"), dtype=x1_p.dtype, device=x1_p.device))
        if s.factor:
            unmask = factor_unmask(x1_p, masked, s.factor_value)
        else:
            unmask = x1_p > s.threshold
            unmask[torch.arange(x1_p.shape[0]), x1_p.argmax(dim=-1)] = True
            unmask = unmask & masked
        x_1 = x_1.expand_as(masked)
        before = x[:, sub].clone()
        window = x[:, sub]
        window[unmask] = x_1[unmask]  # a view: writes the canvas
        self.finished |= ((x_1 == s.stop_token) & unmask).any(dim=1)
        committed = torch.zeros_like(x, dtype=torch.bool)
        committed[:, sub] = unmask & (x_1 != self.mask_id)
        confidence = torch.full(x.shape, float("-inf"), dtype=x1_p.dtype, device=x.device)
        confidence[:, sub] = x1_p
        self.end(state, committed, confidence)
        if s.temperature <= 0 and torch.equal(before, x[:, sub]):
            raise SamplerConfigError(f"step {state.step} committed only the mask token {self.mask_id} (the model's "
                                     "top token): greedy decoding would repeat this step forever, as the reference "
                                     "does.", argument="temperature", value=s.temperature, allowed="> 0")


register(FastDLLMv2Sampler())
