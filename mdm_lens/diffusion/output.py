"""What `generate` returns: the final tokens, the trajectory (who was committed when, with what
confidence), the reducers' records and the trajectory cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


@dataclass
class Trajectory:
    """Per-step facts of a run. Positions index the final sequence `[batch, pos]`."""

    x_steps: Int[Tensor, "step batch pos"]  # model input at each step (ARM: -1 where not yet generated)
    commit_step: Int[Tensor, "batch pos"]  # step that committed each position; -1 for prompt positions
    commit_confidence: Float[Tensor, "batch pos"]  # the sampler's confidence at commit (NaN: prompt/none)
    n_committed: Int[Tensor, "step batch"]
    block_of_step: Int[Tensor, "step"]

    @property
    def n_steps(self) -> int:
        return int(self.x_steps.shape[0])

    def committed_at(self, step: int) -> Bool[Tensor, "batch pos"]:
        return self.commit_step == (step % self.n_steps)

    def order(self, row: int = 0) -> list[int]:
        """Generated positions of one row in the order they were committed (ties by position)."""
        cs = self.commit_step[row]
        gen = (cs >= 0).nonzero().flatten().tolist()
        return sorted(gen, key=lambda p: (int(cs[p]), p))


@dataclass
class GenerateOutput:
    tokens: Int[Tensor, "batch pos"]
    prompt_length: int  # the canvas starts here (prompts are left-padded to this length)
    attention_mask: Int[Tensor, "batch pos"]
    trajectory: Trajectory
    sampler: str
    settings: dict[str, Any]
    causal: bool
    records: dict[str, Tensor] = field(default_factory=dict)
    record_meta: dict[str, dict] = field(default_factory=dict)
    cache: Any = None
    model_name: str = ""
    texts: list[str] | None = None  # decoded generations when the model has a tokenizer

    @property
    def key_visible(self) -> Bool[Tensor, "batch pos"]:
        return self.attention_mask.bool()

    @property
    def generated(self) -> Int[Tensor, "batch gen"]:
        return self.tokens[:, self.prompt_length:]

    @property
    def n_steps(self) -> int:
        return self.trajectory.n_steps

    def __repr__(self) -> str:
        b, t = self.tokens.shape
        lines = [f"GenerateOutput({self.model_name or 'model'}, sampler={self.sampler}, batch={b}, "
                 f"prompt={self.prompt_length}, generated={t - self.prompt_length}, steps={self.n_steps})"]
        shown = {k: v for k, v in self.settings.items() if k not in ("seed",)}
        lines.append("  settings: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
        per_step = self.trajectory.n_committed[:, 0].tolist()
        if len(per_step) > 16:
            per_step = per_step[:8] + ["…"] + per_step[-4:]
        lines.append(f"  commits per step (row 0): {per_step}")
        for name, value in self.records.items():
            axes = self.record_meta.get(name, {}).get("axes")
            lines.append(f"  records[{name!r}]: {tuple(value.shape)}" + (f" {axes}" if axes else ""))
        if self.cache is not None:
            lines.append(f"  cache: {self.cache!r}")
        if self.texts:
            for i, text in enumerate(self.texts[:4]):
                lines.append(f"  [{i}] {text!r}")
        return "\n".join(lines)


class TrajectoryRecorder:
    """Collects the trajectory while a sampler runs."""

    def __init__(self, batch: int, total: int, prompt_length: int, device: torch.device):
        self.x_steps: list[Tensor] = []
        self.blocks: list[int] = []
        self.n_committed: list[Tensor] = []
        self.commit_step = torch.full((batch, total), -2, dtype=torch.long)
        self.commit_step[:, :prompt_length] = -1
        self.commit_confidence = torch.full((batch, total), float("nan"))

    def record(self, step: int, block: int, x_in: Tensor, committed: Tensor, confidence: Tensor | None) -> None:
        pad = self.commit_step.shape[1] - x_in.shape[1]
        x = x_in.detach().cpu()
        if pad:
            x = torch.cat([x, x.new_full((x.shape[0], pad), -1)], dim=1)
        committed = committed.detach().cpu()
        if pad:
            committed = torch.cat([committed, committed.new_zeros((committed.shape[0], pad))], dim=1)
        self.x_steps.append(x)
        self.blocks.append(block)
        self.n_committed.append(committed.sum(-1))
        self.commit_step[committed] = step
        if confidence is not None:
            conf = confidence.detach().float().cpu()
            if pad:
                conf = torch.cat([conf, conf.new_full((conf.shape[0], pad), float("nan"))], dim=1)
            self.commit_confidence[committed] = conf[committed]

    def finish(self) -> Trajectory:
        return Trajectory(torch.stack(self.x_steps), self.commit_step, self.commit_confidence,
                          torch.stack(self.n_committed), torch.tensor(self.blocks))
