"""`DenoisingState`: what a hook can know about the denoising step that is running.

The sampler sets `model.state` before each forward pass and fills the post-commit fields
(`committed`, `committed_confidence`) after it, before calling the reducers' `end_step`.

Rows and keys of a forward (one mechanism for every sampler). A forward may compute only some rows of the canvas
(SDAR / Fast-dLLM v2 / LLaDA2 blocks, Fast-dLLM `kv_cache` windows, a replay's prefix) and attend to keys some of
which come from a KV cache. `query_rows` is the slice of canvas positions (columns of `x`) whose rows the forward
computes, in the order hooks see them (row r of a hooked tensor is position `query_rows.start + r`);
`key_cols` the slice of canvas positions its attention keys cover, cached keys included (key column c of
`hook_pattern` is position `key_cols.start + c`; cached keys were computed at `extra["kv_age"]`). None means all
of `x`. Positions are indices into the state's canvas `x`: the absolute sequence positions for every `HookedMDM`
sampler (prompt at 0, left pads included); DiffusionGemma's decoder canvas starts at `block_slice.start` of its
sequence. Pad positions are computed rows like any other: consumers drop them through `key_visible`.
`query_positions` / `key_positions` give the same facts as `[batch, rows]` / `[batch, keys]` index tensors.
Keys that are not one run of positions (a BD3LM KV-cached run whose unfinished blocks were not stored attends to
[stored blocks; own block]) set `key_index`, the position of every key column; `key_cols` is then their span and
`key_positions` is the truth (`keys_contiguous` says which).

Variable-length runs (DreamOn's expand / delete, LLaDA2.2's InDel: `mdm_lens.diffusion.varlen`) insert and remove
rows mid-run, so column j of `x` is not the same token slot at every step. `slot` names each column's slot (an id
that follows the token through every shift: the slots of step 0's canvas are their positions `0..n_original-1`,
inserted rows get `n_original, n_original+1, ...` in creation order) and `origin` maps each column to its ORIGINAL
position (step 0's canvas), −1 for an inserted row. Fixed-length runs leave `slot` None: `origin` is then the
identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

Phase = Literal["cond", "uncond"]


@dataclass
class DenoisingState:
    step: int  # 0-based index of this step in the whole run
    n_steps: int
    block: int  # semi-autoregressive block index (0 when the sampler has no blocks)
    n_blocks: int
    x: Int[Tensor, "batch pos"]  # the model input at this step (before this step's commit)
    masked: Bool[Tensor, "batch pos"]  # positions still masked in x (ARM: positions not yet generated)
    prompt: Bool[Tensor, "batch pos"]  # prompt positions (pads included, as in LLaDA's prompt_index)
    key_visible: Bool[Tensor, "batch pos"]  # non-pad keys that exist at this step
    block_slice: slice | None = None  # the canvas block being decoded (LLaDA semi-AR)
    phase: Phase = "cond"  # "uncond" during the classifier-free-guidance forward (prompt masked)
    query_position: Int[Tensor, "batch"] | None = None  # ARM: the position whose logits emit the token
    # filled after the forward pass
    confidence: Float[Tensor, "batch pos"] | None = None  # the sampler's confidence at masked positions
    committed: Bool[Tensor, "batch pos"] | None = None  # positions committed by this step
    extra: dict = field(default_factory=dict)
    query_rows: slice | None = None  # canvas positions whose rows this forward computes (None: all of x)
    key_cols: slice | None = None  # canvas positions its attention keys cover, cached ones included (None: all)
    slot: Int[Tensor, "batch pos"] | None = None  # variable-length runs: the slot id of each column of x
    n_original: int | None = None  # variable-length runs: the width of step 0's canvas (slots below it are original)
    key_index: Int[Tensor, "keys"] | None = None  # keys that are not one run of positions: each column's position

    @property
    def variable_length(self) -> bool:
        return self.slot is not None

    @property
    def origin(self) -> Int[Tensor, "batch pos"]:
        """Each column's position in step 0's canvas; −1 for a row inserted during the run (module docstring)."""
        if self.slot is None:
            return torch.arange(self.x.shape[1], device=self.x.device).expand(self.x.shape[0], -1)
        return torch.where(self.slot < int(self.n_original), self.slot, torch.full_like(self.slot, -1))

    def computes(self, lo: int, hi: int, key_end: int | None = None) -> "DenoisingState":
        """Set the forward's rows to positions [lo, hi) and its keys to [0, key_end) (default [0, hi));
        returns the state. Keys always start at 0: every cached forward here attends to a prefix of the canvas."""
        self.query_rows = slice(int(lo), int(hi))
        self.key_cols = slice(0, int(hi if key_end is None else key_end))
        return self

    @property
    def rows(self) -> slice:
        """`query_rows` resolved against `x` (a concrete `slice(start, stop)`)."""
        n = self.x.shape[1]
        return slice(0, n) if self.query_rows is None else slice(*self.query_rows.indices(n)[:2])

    @property
    def keys(self) -> slice:
        """`key_cols` resolved against `x` (a concrete `slice(start, stop)`)."""
        n = self.x.shape[1]
        return slice(0, n) if self.key_cols is None else slice(*self.key_cols.indices(n)[:2])

    @property
    def query_positions(self) -> Int[Tensor, "batch rows"]:
        """The canvas position of each row the forward computes (the same for every batch row)."""
        r = self.rows
        return torch.arange(r.start, r.stop, device=self.x.device).expand(self.x.shape[0], -1)

    @property
    def key_positions(self) -> Int[Tensor, "batch keys"]:
        """The canvas position of each key column of the forward's attention (cached keys included)."""
        if self.key_index is not None:
            return self.key_index.to(self.x.device).expand(self.x.shape[0], -1)
        k = self.keys
        return torch.arange(k.start, k.stop, device=self.x.device).expand(self.x.shape[0], -1)

    @property
    def keys_contiguous(self) -> bool:
        """Whether key column c is position `keys.start + c` (False: read `key_positions`)."""
        return self.key_index is None

    @property
    def is_first(self) -> bool:
        return self.step == 0

    @property
    def is_last(self) -> bool:
        """True at the run's last step (both phases of it under CFG). Runs of unknown length (threshold / factor /
        EB commits, block samplers, stop tokens: `extra["unknown_length"]`, set by the step runner) decide that
        only after the step's commits, so asking during their forwards raises `UnknownLengthError` rather than
        answer False at the real last step. A replay knows the run's length (`extra["n_run"]`) and answers."""
        why = self.extra.get("unknown_length")
        if why:
            from mdm_lens.errors import UnknownLengthError

            raise UnknownLengthError(f"state.is_last is unknown at step {self.step}: {why}, so whether this forward is "
                                     f"the last is decided only after it (n_steps={self.n_steps} is a bound). Use "
                                     "out.n_steps after the run, or out.state_at(step).is_last.")
        return self.step == int(self.extra.get("n_run", self.n_steps)) - 1

    def __repr__(self) -> str:
        n_masked = int(self.masked[0].sum())
        done = "" if self.committed is None else f", committed={int(self.committed[0].sum())}"
        return (f"DenoisingState(step={self.step}/{self.n_steps}, block={self.block}/{self.n_blocks}, "
                f"phase={self.phase}, masked={n_masked}{done})")
