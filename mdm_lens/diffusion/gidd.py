"""GIDD's sampler (`GiddSampler` of dvruette/gidd @ f67acc96, families-2.md §5.1), step by step and observable.

ts = (1 − 2·t_eps)·linspace(0, 1, steps + 1) + t_eps; from the all-[MASK] canvas, for i = steps−1 … 0 with
t = ts[i], s = ts[max(0, i−1)] (the last step has s = t): p = softmax(logits with the [MASK] logit at −1e6),
q(z_s | z_t, p) = q_ts(z_t | ·)·q_s / q_t(z_t) under the hybrid noise (`HybridNoise`), optional `min_p`
truncation, and an inverse-CDF draw (one uniform per position in q's dtype, last cumulative entry 1 + 1e-4,
`searchsorted(right=True)`). Every position is redrawn each step; [MASK] may survive. A prompt is restored after
every step (an extension: the reference generates unconditionally). The reference pipeline runs under bf16
autocast by default; this runs in the model dtype (fp32 for exactness)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens.ddit.outputs import NEG_INFINITY as MASK_LOGIT  # −1e6, as GiddSampler
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.canvas import CanvasSettings, Plan
from mdm_lens.diffusion.ddit import DDiTSampler, _full_mask, commit, masked_canvas, warn_masked_answer
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import register, resolved
from mdm_lens.noisy import hybrid_noisy
from mdm_lens.errors import NonFiniteError


@dataclass
class GiddSettings(CanvasSettings):
    """`num_inference_steps` 128 (the pipeline default), `min_p` 0.0; `t_eps` from the checkpoint (1e-4)."""

    steps: int | None = 128
    min_p: float = 0.0
    t_eps: float | None = resolved()  # the checkpoint's; kept in out.settings so a replay rebuilds each step's t
    p_uniform: float | None = resolved()  # the checkpoint's; says which positions a step's state calls noisy

    def resolve(self, model: Any) -> "GiddSettings":
        return dataclasses.replace(self, **self.lengths(model), min_p=R.apply(self, "min_p"),
            t_eps=float(model.cfg.extra["t_eps"]), p_uniform=float(model.cfg.extra["p_uniform"]))


# min_p = 1 zeroes every entry below probability 1 (all of them short of a one-hot): nothing left to renormalise
GiddSettings.rules = {**CanvasSettings.rules, "min_p": R.number(0, 1, high_open=True)}


def _min_p(q: Tensor, min_p: float, prompt: Tensor, step: int) -> Tensor:
    """The reference's filter: entries below `min_p` zeroed, renormalised. Where a generated position keeps no entry
    (its largest probability is below `min_p`), the reference renormalises 0/0 and draws from NaN (a garbage id);
    that is refused here, naming the step, the position and its largest probability."""
    kept = q * (q >= min_p)
    total = kept.sum(-1, keepdim=True)
    empty = (total[..., 0] == 0) & ~prompt
    if bool(empty.any()):
        row, pos = (int(i) for i in empty.nonzero()[0])
        raise NonFiniteError(f"min_p={min_p} left no candidate at step {step} (row {row}, position {pos}: its largest "
                             f"posterior probability is {float(q[row, pos].max()):.3g}), so the draw would be from "
                             "0/0. Lower min_p.", argument="min_p", value=min_p,
                             allowed=f"a value ≤ {float(q[row, pos].max()):.3g} here, or 0 (no filter)")
    return kept / total


def inverse_cdf(q: Tensor, generator: torch.Generator | None) -> Tensor:
    """`gidd.utils.sample_categorical`."""
    u = torch.rand(q.shape[:-1], dtype=q.dtype, generator=generator).to(q.device)[..., None]
    cum = q.cumsum(-1)
    cum[..., -1] = 1 + 1e-4
    return torch.searchsorted(cum, u, right=True).squeeze(-1)


def gidd_posterior(noise: Any, logits: Tensor, z: Tensor, t: Tensor, s: Tensor) -> Tensor:
    """q(z_s = · | z_t = z, p) of the reference's `DenoisingStep` ([batch, pos, vocab])."""
    p = logits.softmax(-1)
    q_s, q_t = noise.probs_at_t(p, s), noise.probs_at_t(p, t)
    q_zt = q_t.gather(-1, z[..., None])
    a_t, bp_t = noise.alpha_betapi(t)
    a_s, bp_s = noise.alpha_betapi(s)
    a_ts, bp_ts = a_t / a_s, bp_t - a_t / a_s * bp_s
    onehot = F.one_hot(z, num_classes=logits.shape[-1])
    q_ts = a_ts * onehot + bp_ts[:, None].expand_as(onehot).gather(-1, z[..., None])
    return q_ts * q_s / q_zt


class GiddSampler(DDiTSampler):
    name, Settings, family = "gidd", GiddSettings, "gidd"
    neutral = dict(min_p=0.0)

    def plan(self, s: Any) -> Plan:
        return Plan(s.steps)

    def logit_bytes(self, s: Any, dtype_bytes: int) -> int:
        """The posterior's buffers per logit beside the logits: their masked copy, p, q_s, q_t, q_ts · q_s and its
        quotient (model dtype), the int64 one-hot of z_t and the fp32 α_ts · one-hot and q_ts."""
        return 6 * dtype_bytes + 8 + 2 * 4

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: GiddSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        mask_id, batch = model.cfg.mask_token_id, ids.shape[0]
        x, prompt, recorder = masked_canvas(ids, s.gen_length, mask_id)
        noise = model.noise()
        ts = _grid(s.steps, s.t_eps)
        for k, i in enumerate(range(s.steps - 1, -1, -1)):
            t, s_ = ts[i], ts[max(0, i - 1)]
            logits = self.forward(runner, k, s.steps, x, prompt, t.expand(batch), t.expand(batch), mask_id,
                                  hybrid_noisy(x, prompt, mask_id, s.p_uniform))
            logits = logits.clone()
            logits[..., mask_id] = MASK_LOGIT
            q = gidd_posterior(noise, logits, x, t.to(x.device), s_.to(x.device))
            if s.min_p > 0:
                q = _min_p(q, s.min_p, prompt, k)
            x_new = torch.where(prompt, x, inverse_cdf(q, generator))
            commit(runner, recorder, k, x, x_new)
            x = x_new
            if bar is not None:
                bar.update(1)
        warn_masked_answer(x, ids.shape[1], model, self.name)
        return x, _full_mask(am, x), recorder


    def step_time(self, settings: dict, step: int, batch: int) -> tuple[Tensor, Tensor]:
        """(t, t) `[batch]` of step `step`: GIDD is conditioned on the time itself (passed as sigma)."""
        t = _grid(settings["steps"], settings["t_eps"])[settings["steps"] - 1 - step, 0] * torch.ones(batch)
        return t, t

    def replay_state(self, out: Any, state: Any) -> Any:
        state = super().replay_state(out, state)
        state.masked = hybrid_noisy(state.x, state.prompt, out.settings["mask_id"], out.settings["p_uniform"])
        return state


def _grid(steps: int, eps: float) -> Tensor:
    """`[steps + 1, 1]` times (1 − 2·eps)·linspace(0, 1, steps + 1) + eps; step k runs at index steps − 1 − k."""
    return (1 - 2 * eps) * torch.linspace(0, 1, steps + 1)[:, None] + eps


register(GiddSampler())
