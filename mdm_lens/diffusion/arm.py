"""Autoregressive decoding for the ARM twins through the same observable loop: step s is one
forward pass over the prefix of length `prompt + s`, whose last position emits token `prompt + s`.
No KV cache: every step's hooks see the whole prefix, exactly like a denoising step sees its canvas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens import validate
from mdm_lens.diffusion.arguments import filters
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan
from mdm_lens.diffusion.noise import sample_tokens
from mdm_lens.diffusion.registry import register
from mdm_lens.errors import SamplerConfigError
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.hooks.reducers import ReceivedAttention


def arm_sample(runner: Any, prompt: Tensor, attention_mask: Tensor, *, gen_length: int, temperature: float = 0.0,
               top_p: float | None = None, top_k: int | None = None, eos_id: int | None = None,
               stop_at_eos: bool = False, generator: torch.Generator | None = None,
               progress: Any = None) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
    batch, prompt_length = prompt.shape
    total = prompt_length + gen_length
    recorder = TrajectoryRecorder(batch, total, prompt_length, prompt.device)
    x, am = prompt, attention_mask
    done = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
    for s in range(gen_length):
        pos = x.shape[1]
        prompt_index = torch.zeros_like(x, dtype=torch.bool)
        prompt_index[:, :prompt_length] = True
        state = DenoisingState(s, gen_length, 0, 1, x.clone(), torch.zeros_like(prompt_index), prompt_index,
                               am.bool(), query_position=torch.full((batch,), pos - 1, device=x.device))
        logits = runner.forward(state, x, attention_mask=am)[:, -1]
        conf, token = sample_tokens(logits, temperature, top_p, top_k, generator=generator)
        if stop_at_eos and eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        committed = torch.zeros(batch, pos + 1, dtype=torch.bool, device=x.device)
        committed[:, pos] = True
        confidence = torch.full((batch, pos + 1), float("-inf"), device=x.device)
        confidence[:, pos] = conf.float()
        state.confidence, state.committed = confidence, committed
        runner.end_step(state)
        x = torch.cat([x, token[:, None]], dim=1)
        am = torch.cat([am, torch.ones_like(am[:, :1])], dim=1)
        recorder.record(s, 0, torch.cat([state.x, torch.full_like(token[:, None], -1)], dim=1), committed, confidence)
        if progress is not None:
            progress.update(1)
        if stop_at_eos and bool(done.all()):
            break
    return x, am, recorder


@dataclass
class ARMSettings(CanvasSettings):
    """Greedy by default (temperature 0, no filters); one step per token, so `steps` is gen_length. With
    `stop_at_eos` a row that emitted EOS keeps emitting it and the run ends when every row has."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    stop_at_eos: bool = False

    def resolve(self, model: Any) -> "ARMSettings":
        n = self.lengths(model)
        if n["steps"] != n["gen_length"]:
            raise SamplerConfigError(f"steps={n['steps']} but an ARM takes one step per token: steps must equal "
                                     f"gen_length={n['gen_length']} (or be left unset).", argument="steps",
                                     value=n["steps"], allowed=f"{n['gen_length']}")
        stop = validate.boolean(self.stop_at_eos, name="stop_at_eos")
        if stop and model.cfg.eos_token_id is None:
            raise SamplerConfigError("stop_at_eos=True but the model has no EOS id (cfg.eos_token_id is None).",
                                     argument="stop_at_eos", value=True, allowed="a model with cfg.eos_token_id")
        return dataclasses.replace(self, **n, temperature=self.temperature_or(0.0), **filters(self.top_p, self.top_k),
                                   stop_at_eos=stop)


ARMSettings.rules = {**CanvasSettings.rules, "temperature": R.number(0, none=True),
                     **R.sampling_filters(),
                     "stop_at_eos": R.boolean()}

class ARMSampler(CanvasSampler):
    name, Settings = "arm", ARMSettings
    causal = True
    neutral = dict(stop_at_eos=False, top_p=None, top_k=None)

    def check_run(self, ids: Tensor, am: Tensor, s: Any, obs: Any) -> None:
        # an ARM forward's query rows are the prefix it extends: no row is masked, and the token a step commits is
        # appended after the forward, so it is no query row of it either. A "masked"/"committed" query set would be
        # an all-NaN record that the probes downstream read as numbers (0 anchors), so it is refused before compute.
        records = obs.record if isinstance(obs.record, (list, tuple)) else [obs.record] if obs.record else []
        for r in records:
            if isinstance(r, ReceivedAttention) and r.query in ("masked", "committed"):
                raise SamplerConfigError(
                    f"{type(r).__name__}(query={r.query!r}) on sampler='arm': an ARM step has no {r.query} query "
                    "rows (nothing is masked, and each step's token is appended after its forward), so the record "
                    "would be all NaN. Use query='all', 'prompt' or 'generated'.",
                    argument="query", value=r.query, allowed="'all', 'prompt' or 'generated' on an ARM run")

    def plan(self, s: ARMSettings) -> Plan:
        if s.stop_at_eos:
            return Plan(s.gen_length, adaptive="stop_at_eos ends the run when every row has emitted EOS")
        return Plan(s.gen_length)

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: ARMSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        return arm_sample(runner, ids, am, gen_length=s.gen_length, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, eos_id=model.cfg.eos_token_id, stop_at_eos=s.stop_at_eos,
                          generator=generator, progress=bar)


register(ARMSampler())
