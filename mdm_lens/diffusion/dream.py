"""Dream's `diffusion_generate` (HKUNLP/Dream `generation_utils.py`), step by step and observable.

Timesteps `linspace(1, eps, steps+1)`; algorithms `origin` (random unmasking w.p. 1 − s/t),
`maskgit_plus` (top-1 probability), `topk_margin` (p1 − p2), `entropy` (negative entropy); commits
by top-k or, with `alg_temp`, by sampling; temperature, top-p, top-k; logits already aligned (the
one-position shift) by the model (architectures.md §4.4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.arguments import filters, optional
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, masked_canvas
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import register
from mdm_lens.diffusion.schedules import dream_schedule, dream_timesteps, dream_transfer_count
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def top_p_logits(logits: Tensor, top_p: float) -> Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()  # keep the first token past the threshold
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits: Tensor, top_k: int) -> Tensor:
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(logits: Tensor, temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                  margin_confidence: bool = False, neg_entropy: bool = False,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Dream's `sample_tokens`: (confidence, token) per row of `logits [n, vocab]`."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs.float().cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
        confidence = torch.gather(probs, -1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top2 = torch.sort(probs, dim=-1, descending=True)[0][:, :2]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


def dream_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, steps: int,
                 mask_id: int, eps: float = 1e-3, alg: str = "origin", alg_temp: float | None = None,
                 temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                 generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = attention_mask.bool()
    ts = dream_timesteps(steps, eps, device=x.device)
    for i in range(steps):
        mask_index = x == mask_id
        state = DenoisingState(i, steps, 0, 1, x.clone(), mask_index, prompt_index, key_visible)
        logits = runner.forward(state, x, attention_mask=attention_mask)
        mask_logits = logits[mask_index]
        t, s = ts[i], ts[i + 1]
        confidence = torch.full(x.shape, float("-inf"), device=x.device)
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full(mask_logits.shape[:1], mask_id, dtype=x.dtype, device=x.device)
            chosen = torch.rand(x0.shape, generator=generator, device="cpu").to(x.device) < p_transfer
            if chosen.any():
                _, x0[chosen] = sample_tokens(mask_logits[chosen], temperature, top_p, top_k, generator=generator)
            x_new = x.clone()
            x_new[mask_index] = x0
            confidence[mask_index] = float("nan")  # origin commits in random order: no confidence
        else:
            conf, x0 = sample_tokens(mask_logits, temperature, top_p, top_k, margin_confidence=alg == "topk_margin",
                                     neg_entropy=alg == "entropy", generator=generator)
            n_mask_mean = mask_index.sum() / mask_index.shape[0]  # batch mean: a reference quirk, kept
            k = dream_transfer_count(n_mask_mean, t, s, last=i == steps - 1)
            full = torch.full(x.shape, float("-inf"), dtype=logits.dtype, device=x.device)
            full[mask_index] = conf
            confidence = full.float()
            x_new = x.clone()
            if k > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full, k)
                else:
                    weights = torch.softmax(full / alg_temp, dim=-1)
                    transfer_index = torch.multinomial(weights.float().cpu(), k, generator=generator).to(x.device)
                candidate = torch.full_like(x, mask_id)
                candidate[mask_index] = x0.clone()
                rows = torch.arange(batch, device=x.device)[:, None].expand_as(transfer_index)
                x_new[rows, transfer_index] = candidate[rows, transfer_index]
        committed = mask_index & (x_new != mask_id)
        state.confidence, state.committed = confidence, committed
        runner.end_step(state)
        recorder.record(i, 0, state.x, committed, confidence)
        x = x_new
        if progress is not None:
            progress.update(1)
    return x, recorder


@dataclass
class DreamSettings(CanvasSettings):
    """`diffusion_generate` as users run it, without a `generation_config`: the unset sampling settings come from
    the model config's legacy generation attributes (transformers 4.x `PretrainedConfig`: temperature 1.0, top_p
    1.0, top_k 50), not from `DreamGenerationConfig`'s own defaults (0.0 / None / None) nor from the checkpoint's
    generation_config.json. So an unset `temperature` samples at 1.0 under a top-50 filter, exactly as there;
    pass `top_k=None` (or `top_p=None`) to switch a filter off. `steps` defaults to gen_length (the reference's
    512 does not depend on the length)."""

    temperature: float = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 50
    alg: str = "origin"
    alg_temp: float | None = None
    eps: float = 1e-3

    def resolve(self, model: Any) -> "DreamSettings":
        return dataclasses.replace(
            self, **self.lengths(model), temperature=self.temperature_or(1.0), **filters(self.top_p, self.top_k),
            alg=validate.choice(self.alg, ALGORITHMS, name="alg", error=SamplerConfigError),
            alg_temp=optional(self.alg_temp, lambda v: validate.number(v, name="alg_temp", min=0,
                                                                       error=SamplerConfigError)),
            eps=validate.number(self.eps, name="eps", min=0, max=1, min_open=True, max_open=True,
                                error=SamplerConfigError))


class DreamSampler(CanvasSampler):
    name, Settings = "dream", DreamSettings
    neutral = dict(alg="origin", alg_temp=None, eps=1e-3, top_p=None, top_k=None)

    def idle_steps(self, s: DreamSettings) -> list[int] | None:
        if s.alg == "origin":
            return None  # random order
        return [step for step, c in enumerate(dream_schedule(s.gen_length, s.steps, s.eps)) if c == 0]

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: DreamSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        x, am = masked_canvas(ids, am, s.gen_length, model.cfg.mask_token_id)
        x, recorder = dream_sample(runner, x, am, ids.shape[1], steps=s.steps, mask_id=model.cfg.mask_token_id,
                                   eps=s.eps, alg=s.alg, alg_temp=s.alg_temp, temperature=s.temperature,
                                   top_p=s.top_p, top_k=s.top_k, generator=generator, progress=bar)
        return x, am, recorder


register(DreamSampler())
