"""Parallel decoding rules of Fast-dLLM and EB-sampler on LLaDA, step by step and observable.

* `threshold` / `factor` (`sampler="llada", threshold=0.9` or `factor=1.0`): NVlabs/Fast-dLLM `llada/generate.py`
  `generate` (no cache; @24cc59e for the threshold rule, `get_transfer_index_dynamic` of the later file for the
  factor rule). Per block, forward until the block holds no mask; confidences are float64 softmax probabilities of
  the (Gumbel-)argmax token, as there (LLaDA's own loop uses the logits' dtype).
* `sampler_rule="eb", gamma=...`: EB-sampler (yks23/Information-Gain-Sampler `generate_with_eb_sampler`): over the
  whole canvas (no blocks), sort the masked positions by the entropy of their predictive distribution and commit
  the longest prefix whose cumulative entropy minus its largest entropy is <= gamma (at least one).

The number of forwards depends on the confidences, so a run's length is known only at its end: `steps` bounds
nothing here (the reference loops until the block is full), step selectors counted from the end are refused, and
`out.trajectory.n_steps` is the number of forwards that ran.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens.diffusion.noise import add_gumbel_noise
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.schedules import llada_transfer_counts
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError
from mdm_lens.kvcache import KVCache


def threshold_transfer(confidence: Float[Tensor, "batch pos"], masked: Bool[Tensor, "batch pos"],
                       threshold: float) -> Bool[Tensor, "batch pos"]:
    """Fast-dLLM's threshold rule: the masked positions ranked by confidence (`torch.topk` order, ties as topk
    breaks them); the first always commits, every later one when its confidence is not below `threshold`."""
    confidence = _only_masked(confidence, masked)
    transfer = torch.zeros_like(masked)
    for j in range(confidence.shape[0]):
        n = int(masked[j].sum())
        if n == 0:
            continue
        _, order = torch.topk(confidence[j], k=n)
        keep = confidence[j, order] >= threshold
        keep[0] = True
        transfer[j, order[keep]] = True
    return transfer


def factor_transfer(confidence: Float[Tensor, "batch pos"], masked: Bool[Tensor, "batch pos"],
                    factor: float) -> Bool[Tensor, "batch pos"]:
    """Fast-dLLM's dynamic rule: rank the masked confidences c_1 >= c_2 >= ...; rank n passes when
    c_n >= 1 - factor / (n + 1), rank 1 always. Commit the ranks before the first that fails, with the reference's
    edge case kept: when only the last rank fails (or none does) every masked position commits."""
    confidence = _only_masked(confidence, masked)
    transfer = torch.zeros_like(masked)
    for j in range(confidence.shape[0]):
        n = int(masked[j].sum())
        if n == 0:
            continue
        ranked = torch.sort(confidence[j][masked[j]], descending=True).values
        thresholds = [-1.0] + [1 - factor / (r + 1) for r in range(2, n + 1)]
        first_fail = next((r for r in range(n) if ranked[r] < thresholds[r]), n - 1)
        k = first_fail + 1 if first_fail in (0, n - 1) else first_fail
        _, order = torch.topk(confidence[j], k=k)
        transfer[j, order] = True
    return transfer


def _only_masked(confidence: Tensor, masked: Tensor) -> Tensor:
    """-inf outside the masked positions (as the reference's callers build it), so a ranking never picks them."""
    return confidence.masked_fill(~masked, float("-inf"))


def eb_transfer(entropy: Float[Tensor, "batch pos"], masked: Bool[Tensor, "batch pos"],
                gamma: float) -> Bool[Tensor, "batch pos"]:
    """EB-sampler's rule: masked positions by ascending entropy (`argsort` order); commit the longest prefix whose
    sum of entropies minus its largest is <= gamma, at least one."""
    transfer = torch.zeros_like(masked)
    for j in range(entropy.shape[0]):
        where = masked[j].nonzero().flatten()
        if where.numel() == 0:
            continue
        h = entropy[j, where]
        order = torch.argsort(h)
        ranked = h[order]
        error = torch.cumsum(ranked, 0) - torch.cummax(ranked, 0).values
        k = int(min(max(int((error <= gamma).sum()), 1), where.numel()))
        transfer[j, where[order[:k]]] = True
    return transfer


def _noisy_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    return torch.argmax(add_gumbel_noise(logits, temperature, generator), dim=-1)


def fastdllm_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, gen_length: int,
                    block_length: int, temperature: float, remasking: str, mask_id: int,
                    threshold: float | None, factor: float | None, budget: int,
                    generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    """Fast-dLLM's `generate` loop (no KV cache) with the threshold or factor rule; `budget` bounds the forwards
    (the reference would loop forever if the model kept predicting the mask token itself)."""
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = attention_mask.bool()
    n_blocks = gen_length // block_length
    step = 0
    for b in range(n_blocks):
        blk = slice(prompt_length + b * block_length, prompt_length + (b + 1) * block_length)
        while True:
            if step >= budget:
                raise SamplerConfigError(f"block {b} still holds mask tokens after {budget} forwards: the model keeps "
                                         f"predicting the mask token {mask_id} itself (the reference would loop "
                                         "forever).", argument="threshold", value=threshold)
            masked = x == mask_id
            state = DenoisingState(step, budget, b, n_blocks, x.clone(), masked, prompt_index, key_visible, blk)
            logits = runner.forward(state, x, attention_mask=attention_mask)
            eligible = masked.clone()
            eligible[:, blk.stop:] = False
            x0, transfer, confidence = propose(logits, x, eligible, temperature, remasking, threshold, factor,
                                               None, generator)
            x_in = state.x
            x = torch.where(transfer, x0, x)
            _end(runner, recorder, state, step, b, x_in, transfer, confidence, progress)
            step += 1
            if not bool((x[:, blk] == mask_id).any()):
                break
    return x, recorder


def cached_sample(runner: Any, model: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, kv_cache: str,
                  steps: int, gen_length: int, block_length: int, temperature: float, remasking: str, mask_id: int,
                  threshold: float | None, factor: float | None, budget: int, generator: torch.Generator | None = None,
                  progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    """`generate_with_prefix_cache` / `generate_with_dual_cache` (Fast-dLLM @ 24cc59e): per block one full forward
    that fills the cache and commits by the block schedule's first count (or the rule), then window forwards
    (prefix: from the block start to the end; dual: the block) against the cache until the block holds no mask.
    As there, the first window forward runs even when the block-start forward filled the block, and the prefix
    loop draws one set of Gumbel noise it does not use before each commit (at temperature > 0)."""
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = attention_mask.bool()
    n_blocks = gen_length // block_length
    cache = KVCache(model, total)
    step = 0
    for b in range(n_blocks):
        start, end = prompt_length + b * block_length, prompt_length + (b + 1) * block_length
        blk = slice(start, end)
        counts = llada_transfer_counts(x[:, blk] == mask_id, steps // n_blocks)
        i = 0
        while True:
            lo, hi, masked, state, logits = window_forward(runner, cache, x, step, budget, b, n_blocks, i, kv_cache,
                                                           start, end, prompt_index, key_visible, mask_id)
            eligible = masked[:, lo:hi].clone()
            eligible[:, end - lo:] = False
            if i > 0 and kv_cache == "prefix":
                add_gumbel_noise(logits, temperature, generator)  # the reference's unused draw
            if threshold is None and factor is None and i >= counts.shape[1]:
                raise SamplerConfigError(f"block {b} still holds mask tokens after its {counts.shape[1]} scheduled "
                                         f"steps: the model predicted the mask token {mask_id} itself.",
                                         argument="steps", value=steps)
            count = counts[:, i] if i < counts.shape[1] else None
            x0, transfer, confidence = propose(logits, x[:, lo:hi], eligible, temperature, remasking, threshold,
                                               factor, count, generator)
            x_in = state.x
            full = torch.zeros_like(masked)
            full[:, lo:hi] = transfer
            conf = torch.full(x.shape, float("-inf"), dtype=confidence.dtype, device=x.device)
            conf[:, lo:hi] = confidence
            x = x.clone()
            x[:, lo:hi] = torch.where(transfer, x0, x[:, lo:hi])
            _end(runner, recorder, state, step, b, x_in, full, conf, progress)
            step += 1
            if i > 0 and not bool((x[:, blk] == mask_id).any()):
                break
            i += 1
    return x, recorder


def window_forward(runner: Any, cache: KVCache, x: Tensor, step: int, budget: int, b: int, n_blocks: int, i: int,
                   kv_cache: str, start: int, end: int, prompt_index: Tensor, key_visible: Tensor,
                   mask_id: int) -> tuple[int, int, Tensor, DenoisingState, Tensor]:
    """One forward of a cached block loop: the block-start refresh (`i == 0`: every row, filling the cache) or a
    window against the cache (prefix: block start to the end; dual: the block). Returns the window, the canvas's
    mask, the step's state (with `refresh`, `query_start`/`query_end` and `kv_age` in `extra`) and its logits."""
    if step >= budget:
        raise SamplerConfigError(f"block {b} still holds mask tokens after {budget} forwards: the model keeps "
                                 f"predicting the mask token {mask_id} itself.", argument="kv_cache", value=kv_cache)
    total = x.shape[1]
    lo, hi = (0, total) if i == 0 else (start, total if kv_cache == "prefix" else end)
    masked = x == mask_id
    cache.computed(lo, hi, step)
    state = DenoisingState(step, budget, b, n_blocks, x.clone(), masked, prompt_index, key_visible, slice(start, end))
    state.computes(lo, hi, total).extra.update(kv_cache=kv_cache, refresh=i == 0, query_start=lo, query_end=hi,
                                              kv_age=cache.age.clone())
    with cache.attached("fill" if i == 0 else kv_cache, (lo, hi)):
        logits = runner.forward(state, x[:, lo:hi], position_ids=torch.arange(lo, hi, device=x.device)[None])
    if i == 0 and kv_cache == "prefix":
        cache.trim(start)
    return lo, hi, masked, state, logits


def propose(logits: Tensor, x: Tensor, eligible: Tensor, temperature: float, remasking: str,
            threshold: float | None, factor: float | None, count: Tensor | None,
            generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Fast-dLLM's `get_transfer_index`: (Gumbel-)argmax tokens, float64 confidences of the eligible positions,
    and the positions to commit by the factor rule, the threshold rule, or the block schedule's `count` per row."""
    x0 = _noisy_argmax(logits, temperature, generator)
    if remasking == "low_confidence":
        p = torch.gather(F.softmax(logits.to(torch.float64), dim=-1), -1, x0[..., None]).squeeze(-1)
    else:
        p = torch.rand(x0.shape, generator=generator, device="cpu", dtype=torch.float32).to(x.device)
    x0 = torch.where(eligible, x0, x)
    confidence = torch.where(eligible, p, torch.tensor(float("-inf"), dtype=p.dtype, device=x.device))
    if factor is not None:
        transfer = factor_transfer(confidence, eligible, factor)
    elif threshold is not None:
        transfer = threshold_transfer(confidence, eligible, threshold)
    else:
        transfer = torch.zeros_like(eligible)
        for j in range(x.shape[0]):
            _, select = torch.topk(confidence[j], k=int(count[j]))  # type: ignore[index]
            transfer[j, select] = True
    return x0, transfer, confidence


def eb_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, gamma: float,
              temperature: float, cfg_scale: float, mask_id: int, budget: int,
              generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    """EB-sampler's loop over the whole canvas: one forward (two with guidance) per step until no mask is left."""
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = x != mask_id
    key_visible = attention_mask.bool()
    step = 0
    while bool((x == mask_id).any()):
        if step >= budget:
            raise SamplerConfigError(f"masks remain after {budget} forwards: the model keeps predicting the mask "
                                     f"token {mask_id} itself (the reference would loop forever).",
                                     argument="gamma", value=gamma)
        masked = x == mask_id
        state = DenoisingState(step, budget, 0, 1, x.clone(), masked, prompt_index, key_visible)
        logits = runner.forward(state, x, attention_mask=attention_mask)
        if cfg_scale > 0:
            un_x = x.masked_fill(prompt_index & key_visible, mask_id)
            uncond = DenoisingState(step, budget, 0, 1, un_x, un_x == mask_id, prompt_index, key_visible,
                                    phase="uncond")
            un_logits = runner.forward(uncond, un_x, attention_mask=attention_mask)
            logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
        x0 = _noisy_argmax(logits, temperature, generator)
        entropy = torch.distributions.Categorical(logits=logits).entropy()
        transfer = eb_transfer(entropy, masked, gamma)
        x_in = state.x
        x = torch.where(transfer, x0, x)
        confidence = torch.where(masked, -entropy.float(), torch.tensor(float("-inf"), device=x.device))
        _end(runner, recorder, state, step, 0, x_in, transfer, confidence, progress)
        step += 1
    return x, recorder


def _end(runner: Any, recorder: TrajectoryRecorder, state: DenoisingState, step: int, block: int, x_in: Tensor,
         transfer: Tensor, confidence: Tensor, progress: Any) -> None:
    state.confidence, state.committed = confidence.float(), transfer
    runner.end_step(state)
    if "kv_cache" in state.extra:  # a cached loop's window: its rows, for out.state_at (replay stays refused)
        recorder.note(state, canvas=False)
    recorder.record(step, block, x_in, transfer, confidence.float())
    if progress is not None:
        progress.update(1)
