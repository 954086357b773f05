"""Fast-dLLM's block decoding of Dream (`dream/model/generation_utils_block.py` @ 24cc59e, `_sample`), step by step
and observable: `sampler="dream", kv_cache="prefix"|"dual", block_length=32` (+ `threshold=0.9` for its
`confidence_threshold` algorithm, or `factor=1.0`).

Per block: one full forward fills the KV cache and commits the block's *first* token (sampled from that forward,
whatever the algorithm); then window forwards (prefix: block start to the end; dual: the block) against the cache:

* with `threshold`: every masked row of the window is sampled; of the block's masked positions, ranked by
  confidence, the first always commits and every later one whose confidence is not below the threshold;
* with `factor`: the same, with Fast-dLLM's factor rule (`fastdllm.factor_transfer`, thr_n = 1 - factor/(n+1)
  over the block's ranked confidences) deciding which commit. Neither reference has a factor path for Dream
  (NVlabs/Fast-dLLM @ 24cc59e `dream/model/generation_utils_block.py` and ZHZisZZ/dllm @ ca176752
  `dllm/pipelines/fastdllm/dream/sampler.py` have only `confidence_threshold`): this is the reference's threshold
  loop (its sampling, window, first-token forward) with LLaDA's factor rule in place of the threshold comparison,
  one prompt at a time as the threshold path;
* without either: Dream's `entropy` rule on the block (negative entropy, whatever `alg` says in the reference: only
  "entropy" is accepted here), `int(n · (1 − s/t))` tokens by `torch.linspace(1, eps, steps_per_block + 1)`
  within the block, all the rest at the block's last scheduled step, `alg_temp` sampling as Dream's; the window
  forward at index `steps_per_block` runs and commits nothing (the reference breaks after it).

Logits are shifted by one within each window, as there (the window's first row keeps its own logit). Unpadded
batches only (the reference's padded cached path slices its mask by key); `threshold` decodes one prompt at a time
(the reference commits row 0 only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion.fastdllm import factor_transfer, window_forward
from mdm_lens.diffusion.noise import sample_tokens
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.schedules import dream_timesteps, dream_transfer_count
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError
from mdm_lens.kvcache import KVCache


def _sample(logits: Tensor, temperature: float, top_p: Any, top_k: Any, generator: Any,
            neg_entropy: bool = False) -> tuple[Tensor, Tensor]:
    """`sample_tokens` over any leading shape (rows in the reference's order, so the draws match)."""
    conf, x0 = sample_tokens(logits.reshape(-1, logits.shape[-1]), temperature, top_p, top_k,
                             neg_entropy=neg_entropy, generator=generator)
    return conf.view(logits.shape[:-1]), x0.view(logits.shape[:-1])


def dream_block_sample(runner: Any, model: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *,
                       kv_cache: str, steps: int, gen_length: int, block_length: int, threshold: float | None,
                       factor: float | None,
                       temperature: float, top_p: float | None, top_k: int | None, alg_temp: float | None,
                       eps: float, mask_id: int, budget: int, generator: torch.Generator | None = None,
                       progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = attention_mask.bool()
    n_blocks = gen_length // block_length
    per_block = steps // n_blocks
    ts = dream_timesteps(per_block, eps, device=x.device)
    cache = KVCache(model, total)
    step = 0
    for b in range(n_blocks):
        start, end = prompt_length + b * block_length, prompt_length + (b + 1) * block_length
        i = 0
        while True:
            lo, hi, masked, state, logits = window_forward(runner, cache, x, step, budget, b, n_blocks, i, kv_cache,
                                                           start, end, prompt_index, key_visible, mask_id)
            window = x[:, lo:hi]
            if i == 0:
                conf, x0 = _sample(logits, temperature, top_p, top_k, generator)
                transfer = torch.zeros_like(window, dtype=torch.bool)
                transfer[:, start] = True
                confidence = torch.where(transfer, conf.float(), torch.tensor(float("-inf"), device=x.device))
            elif threshold is not None or factor is not None:
                x0, transfer, confidence = _threshold_step(logits, window, mask_id, block_length, threshold,
                                                           temperature, top_p, top_k, generator, factor=factor)
            else:
                if i == per_block:  # the reference breaks after this forward, committing nothing
                    _finish(runner, recorder, state, step, b, x, torch.zeros_like(masked), None, progress)
                    step += 1
                    break
                last = i == per_block - 1
                x0, transfer, confidence = _entropy_step(logits, window, mask_id, block_length, ts[i], ts[i + 1],
                                                         last, temperature, top_p, top_k, alg_temp, generator)
                i += 1
            committed = torch.zeros_like(masked)
            committed[:, lo:hi] = transfer
            full_conf = torch.full(x.shape, float("-inf"), device=x.device)
            full_conf[:, lo:hi] = confidence.float()
            x_in = state.x
            x = x.clone()
            x[:, lo:hi] = torch.where(transfer, x0, window)
            _finish(runner, recorder, state, step, b, x_in, committed, full_conf, progress)
            step += 1
            if i == 0:  # the reference enters its window loop without checking the block
                i = 1
                continue
            if not bool((x[:, start:end] == mask_id).any()):
                break
    return x, recorder


def _threshold_step(logits: Tensor, window: Tensor, mask_id: int, block_length: int, threshold: float | None,
                    temperature: float, top_p: Any, top_k: Any, generator: Any,
                    factor: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    masked = window == mask_id
    proposal = torch.full_like(window, mask_id)
    if not bool(masked.any()):  # nothing left to sample (the reference would fail on an empty batch of rows)
        return proposal, torch.zeros_like(masked), torch.full(window.shape, float("-inf"), device=window.device)
    conf, x0 = sample_tokens(logits[masked], temperature, top_p, top_k, generator=generator)
    proposal[masked] = x0
    full = torch.full(window.shape, float("-inf"), dtype=logits.dtype, device=window.device)
    full[masked] = conf
    full[:, block_length:] = float("-inf")
    transfer = torch.zeros_like(masked)
    if factor is not None:  # the block's masked positions, ranked; row 0 as the threshold path
        in_block = masked.clone()
        in_block[:, block_length:] = False
        transfer[:1] = factor_transfer(full[:1], in_block[:1], factor)
        return proposal, transfer, full
    n = int((window[:, :block_length] == mask_id).sum())
    values, index = torch.topk(full, n)
    keep = values[0] >= threshold
    if n:
        keep[0] = True
    transfer[0, index[0][keep]] = True
    return proposal, transfer, full


def _entropy_step(logits: Tensor, window: Tensor, mask_id: int, block_length: int, t: Tensor, s: Tensor,
                  last: bool, temperature: float, top_p: Any, top_k: Any, alg_temp: float | None,
                  generator: Any) -> tuple[Tensor, Tensor, Tensor]:
    masked = window == mask_id
    masked[:, block_length:] = False
    if not bool(masked.any()):
        return torch.full_like(window, mask_id), masked, torch.full(window.shape, float("-inf"), device=window.device)
    conf, x0 = sample_tokens(logits[masked], temperature, top_p, top_k, neg_entropy=True, generator=generator)
    k = dream_transfer_count(masked.sum() / masked.shape[0], t, s, last)
    full = torch.full(window.shape, float("-inf"), dtype=logits.dtype, device=window.device)
    full[masked] = conf
    full[:, block_length:] = float("-inf")
    transfer = torch.zeros_like(masked)
    proposal = torch.full_like(window, mask_id)
    proposal[masked] = x0
    if k > 0:
        if alg_temp is None or alg_temp == 0:
            _, index = torch.topk(full, k)
        else:
            weights = torch.softmax(full / alg_temp, dim=-1)
            index = torch.multinomial(weights.float().cpu(), k, generator=generator).to(window.device)
        rows = torch.arange(window.shape[0], device=window.device)[:, None].expand_as(index)
        transfer[rows, index] = True
    return proposal, transfer, full


def _finish(runner: Any, recorder: TrajectoryRecorder, state: DenoisingState, step: int, block: int, x_in: Tensor,
            committed: Tensor, confidence: Tensor | None, progress: Any) -> None:
    state.confidence, state.committed = confidence, committed
    runner.end_step(state)
    if "kv_cache" in state.extra:  # a cached loop's window: its rows, for out.state_at (replay stays refused)
        recorder.note(state, canvas=False)
    recorder.record(step, block, x_in, committed, confidence)
    if progress is not None:
        progress.update(1)
