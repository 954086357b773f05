"""Bookkeeping for samplers whose canvas changes length mid-run (DreamOn's expand / delete, LLaDA2.2's InDel).

A *slot* is one token row followed through every shift: the rows of step 0's canvas are slots `0..n_original-1`
(their positions), rows inserted later get `n_original, n_original+1, ...` in creation order. `Slots` is edited
alongside the canvas (every insertion, deletion or truncation the sampler does to `x` it also does here), so at
every step `slots.ids[0, j]` says which slot column j is and `DenoisingState.origin` which original position (−1:
inserted). `LengthRecorder` keeps the per-step canvases with their slot maps and, per slot, the step that committed
it (mask → token), the token, and the step it left the canvas (deleted, or replaced by an expansion); `finish`
returns a `Trajectory` whose `commit_step` indexes the final tokens and whose `length` is the `LengthTrace`.

Positions in everything a variable-length run records (x_steps, reducer records, cached activations) are the
columns of *that step's* canvas; `LengthTrace.slot_steps` / `origin_steps` (and the reducers' `meta["origin"]`,
`TrajectoryCache.origin_of`) map them back. Consumers that assume column j is one position across steps refuse
such runs (`require_fixed_length`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mdm_lens.diffusion.fixed_length import refuse_variable_sampler, require_fixed_length  # noqa: F401
from mdm_lens.errors import SamplerConfigError

REMOVED_HOW = {0: "present", 1: "deleted", 2: "replaced", 3: "truncated"}  # codes of LengthTrace.removed_how


class Slots:
    """The slot ids of a one-row canvas (`ids [1, width]`) and which slots are prompt (never decoded)."""

    def __init__(self, prompt: Bool[Tensor, "1 pos"]):
        width = prompt.shape[1]
        self.ids = torch.arange(width)[None]
        self.n_original = width
        self.next = width
        self.is_prompt = prompt[0].detach().cpu().clone().tolist()  # per slot id, grows with insertions

    def new(self, n: int) -> Tensor:
        ids = torch.arange(self.next, self.next + n)
        self.next += n
        self.is_prompt.extend([False] * n)
        return ids

    def insert(self, at: int, ids: Tensor) -> None:
        self.ids = torch.cat([self.ids[:, :at], ids[None], self.ids[:, at:]], dim=1)

    def delete(self, at: int) -> int:
        gone = int(self.ids[0, at])
        self.ids = torch.cat([self.ids[:, :at], self.ids[:, at + 1:]], dim=1)
        return gone

    def truncate(self, width: int) -> list[int]:
        gone = self.ids[0, width:].tolist()
        self.ids = self.ids[:, :width]
        return gone

    def prompt(self, device: torch.device) -> Bool[Tensor, "1 pos"]:
        return torch.tensor([[self.is_prompt[i] for i in self.ids[0].tolist()]], dtype=torch.bool, device=device)


@dataclass
class LengthTrace:
    """The slot facts of a variable-length run (batch 1; axes `[batch, slot]` are indexed by slot id)."""

    n_original: int  # width of step 0's canvas
    slot_steps: Int[Tensor, "step batch pos"]  # slot id of each column of x_steps[s]; −1 beyond that step's canvas
    final_slot: Int[Tensor, "batch pos"]  # slot id of each column of the final tokens
    commit_step: Int[Tensor, "batch slot"]  # step that turned the slot's mask into a token; −1 prompt; −2 never
    commit_token: Int[Tensor, "batch slot"]  # the token it was committed as (−1: prompt / never)
    n_commits: Int[Tensor, "batch slot"]  # mask → token commits of the slot (0 or 1: a slot is masked once)
    removed_step: Int[Tensor, "batch slot"]  # step after which the slot left the canvas; −1: still there
    removed_how: Int[Tensor, "batch slot"]  # REMOVED_HOW: 0 present, 1 deleted, 2 replaced (expansion), 3 truncated
    edit_steps: list[list[int]] | None = None  # InDel: per slot, the steps that rewrote its token (T2T edits)

    @property
    def n_slots(self) -> int:
        return int(self.commit_step.shape[1])

    def origin(self, slot: Tensor) -> Tensor:
        """Original position of each slot id (−1: inserted; −1 stays −1 for padding columns)."""
        return torch.where((slot >= 0) & (slot < self.n_original), slot, torch.full_like(slot, -1))

    @property
    def origin_steps(self) -> Int[Tensor, "step batch pos"]:
        """Original position of each column of x_steps[s] (−1: inserted row, or beyond that step's canvas)."""
        return self.origin(self.slot_steps)

    @property
    def final_origin(self) -> Int[Tensor, "batch pos"]:
        return self.origin(self.final_slot)

    @property
    def widths(self) -> Int[Tensor, "step"]:
        """Each step's canvas width (columns of x_steps[s] that exist)."""
        return (self.slot_steps[:, 0] >= 0).sum(-1)


class LengthRecorder:
    """Collects a variable-length run's trajectory (batch 1), in the coordinates of each step's canvas."""

    def __init__(self, slots: Slots, max_width: int):
        self.slots, self.max_width = slots, max_width
        self.x_steps: list[Tensor] = []
        self.slot_steps: list[Tensor] = []
        self.n_committed: list[int] = []
        self.forwards: list[dict] = []
        self.commit_step: dict[int, int] = {}
        self.commit_token: dict[int, int] = {}
        self.commit_conf: dict[int, float] = {}
        self.n_commits: dict[int, int] = {}
        self.removed: dict[int, tuple[int, int]] = {}
        self.edits: dict[int, list[int]] = {}

    def _pad(self, t: Tensor, value: int) -> Tensor:
        t = t.detach().cpu()
        return torch.cat([t, t.new_full((1, self.max_width - t.shape[1]), value)], dim=1)

    def step(self, state: Any) -> None:
        """The step's canvas and slot map (before its commits), and its forward for `replay`."""
        self.x_steps.append(self._pad(state.x, -1))
        self.slot_steps.append(self._pad(state.slot, -1))
        self.n_committed.append(0)
        self.forwards.append(dict(x=state.x.detach().cpu().clone(), slot=state.slot.detach().cpu().clone(),
                                  masked=state.masked.detach().cpu().clone(),
                                  prompt=state.prompt.detach().cpu().clone(), n_steps=state.n_steps,
                                  block=state.block, n_blocks=state.n_blocks, block_slice=state.block_slice,
                                  extra={k: v for k, v in state.extra.items() if k in ("kind", "block_length", "query_start", "query_end")}))

    def commit(self, step: int, slot: int, token: int, confidence: float = float("nan")) -> None:
        self.n_commits[slot] = self.n_commits.get(slot, 0) + 1
        if slot not in self.commit_step:
            self.commit_step[slot], self.commit_token[slot], self.commit_conf[slot] = step, token, confidence
        self.n_committed[step] += 1

    def edit(self, step: int, slot: int) -> None:
        self.edits.setdefault(slot, []).append(step)

    def remove(self, step: int, slot: int, how: str) -> None:
        code = {v: k for k, v in REMOVED_HOW.items()}[how]
        self.removed[slot] = (step, code)

    def finish(self, final_x: Tensor, n_blocks_of_step: list[int] | None = None) -> "Trajectory":  # noqa: F821
        from mdm_lens.diffusion.output import Trajectory

        n = self.slots.next
        commit = torch.full((1, n), -2, dtype=torch.long)
        token = torch.full((1, n), -1, dtype=torch.long)
        conf = torch.full((1, n), float("nan"))
        n_commits = torch.zeros((1, n), dtype=torch.long)
        removed_step = torch.full((1, n), -1, dtype=torch.long)
        removed_how = torch.zeros((1, n), dtype=torch.long)
        for i in range(n):
            if self.slots.is_prompt[i]:
                commit[0, i] = -1
        for i, s in self.commit_step.items():
            commit[0, i], token[0, i], conf[0, i] = s, self.commit_token[i], self.commit_conf[i]
        for i, c in self.n_commits.items():
            n_commits[0, i] = c
        for i, (s, how) in self.removed.items():
            removed_step[0, i], removed_how[0, i] = s, how
        final = self.slots.ids.clone()
        if final.shape[1] != final_x.shape[1]:
            raise SamplerConfigError(f"internal: the slot map has {final.shape[1]} columns, the canvas "
                                     f"{final_x.shape[1]}: a sampler edited one without the other.")
        edit_steps = [self.edits.get(i, []) for i in range(n)] if self.edits else None
        trace = LengthTrace(self.slots.n_original, torch.stack(self.slot_steps), final, commit, token, n_commits,
                            removed_step, removed_how, edit_steps)
        steps = len(self.x_steps)
        blocks = torch.tensor(n_blocks_of_step if n_blocks_of_step is not None else [0] * steps, dtype=torch.long)
        return Trajectory(torch.stack(self.x_steps), commit[:, final[0]], conf[:, final[0]],
                          torch.tensor(self.n_committed, dtype=torch.long)[:, None], blocks,
                          forwards=self.forwards, length=trace)
