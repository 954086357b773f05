"""`DenoisingState`: what a hook can know about the denoising step that is running.

The sampler sets `model.state` before each forward pass and fills the post-commit fields
(`committed`, `committed_confidence`) after it, before calling the reducers' `end_step`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
