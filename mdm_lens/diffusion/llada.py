"""LLaDA's sampler (`generate.py` of ML-GSAI/LLaDA), step by step and observable.

Semi-autoregressive blocks, a per-block transfer schedule, low-confidence or random remasking,
temperature through float64 Gumbel noise, classifier-free guidance with the prompt masked, and the
optional EOS/EoT logit suppression — as in the reference (architectures.md §2.5)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.schedules import llada_transfer_counts
from mdm_lens.diffusion.state import DenoisingState


def add_gumbel_noise(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """exp(logits) / (−log u)^T in float64: its argmax is a sample from softmax(logits / T).
    The reference insists on float64 (low-precision Gumbel noise hurts generation quality)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device="cpu").to(logits.device)
    return logits.exp() / (-torch.log(u)) ** temperature


def llada_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, steps: int,
                 gen_length: int, block_length: int, temperature: float = 0.0, cfg_scale: float = 0.0,
                 remasking: str = "low_confidence", mask_id: int, logits_eos_inf: bool = False,
                 confidence_eos_eot_inf: bool = False, eos_id: int | None = None, eot_id: int | None = None,
                 generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = x != mask_id  # computed once; pads count as prompt (reference behaviour)
    n_blocks = gen_length // block_length
    steps_per_block = steps // n_blocks
    key_visible = attention_mask.bool()
    step = 0
    for b in range(n_blocks):
        blk = slice(prompt_length + b * block_length, prompt_length + (b + 1) * block_length)
        counts = llada_transfer_counts(x[:, blk] == mask_id, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == mask_id
            state = DenoisingState(step, steps, b, n_blocks, x.clone(), mask_index, prompt_index, key_visible, blk)
            logits = runner.forward(state, x, attention_mask=attention_mask)
            if cfg_scale > 0:
                # The reference masks pads too; pads are hidden keys and never committed, so keeping their pad id
                # changes no used logit and keeps the model's "pad is not the mask id" input check meaningful.
                un_x = x.masked_fill(prompt_index & key_visible, mask_id)
                uncond = DenoisingState(step, steps, b, n_blocks, un_x, un_x == mask_id, prompt_index, key_visible,
                                        blk, phase="uncond")
                un_logits = runner.forward(uncond, un_x, attention_mask=attention_mask)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            if logits_eos_inf:
                logits[..., eos_id] = float("-inf")
            noisy = add_gumbel_noise(logits, temperature, generator)
            x0 = torch.argmax(noisy, dim=-1)
            if confidence_eos_eot_inf:
                # The reference line `logits_with_noise[..., EOS] = logits[..., EoT] = -inf`, after sampling. At
                # temperature 0 the noised tensor *is* the logits, so EOS and EoT confidences both drop to 0; at
                # temperature > 0 the EOS write lands in the noise copy and only EoT's confidence changes.
                if eos_id is not None:  # known whenever it matters (temperature 0): checked before the run
                    noisy[..., eos_id] = float("-inf")
                logits[..., eot_id] = float("-inf")
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)  # in the logits' dtype, as the reference
                x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            else:
                x0_p = torch.rand(x0.shape, generator=generator, device="cpu").to(x.device)
            x0_p[:, blk.stop:] = float("-inf")  # never decode beyond the current block
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p.to(torch.float32), torch.tensor(float("-inf"), device=x.device))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(batch):
                _, select = torch.topk(confidence[j], k=int(counts[j, i]))
                transfer[j, select] = True
            x_in = state.x
            x = torch.where(transfer, x0, x)
            state.confidence, state.committed = confidence, transfer
            runner.end_step(state)
            recorder.record(step, b, x_in, transfer, confidence)
            if progress is not None:
                progress.update(1)
            step += 1
    return x, recorder
