"""The logit lens over denoising steps: every layer's residual stream, read through the final norm and the
unembedding, at every step of one trajectory -- reduced per step, never kept as `[step, layer, pos, vocab]`.

    out = model.generate(prompt, steps=8, gen_length=8)                  # or with cache="blocks.*.hook_resid_post"
    trace = lens_trace(model, out)                                       # LensTrace, [step, layer, batch, position]
    trace.top1, trace.final_rank, trace.to_frame()

Positions are *answer positions*: indices into the generated canvas (0 = the first generated token), the same
for every row of a left-padded batch. The "final token" of a position is the token the run returned
(`out.tokens`): LLaDA and Dream never change a committed token, so it is also the committed one; a sampler that
re-decides (renoising) is judged against what it finally output.

Dream's logit shift is respected: the prediction for position i is read from layer l's residual at i-1, as the
model's own aligned logits are. The residuals come from `out.cache` when it holds `blocks.{l}.hook_resid_post` for
every requested step and layer, else each step's forward is replayed (`out.replay`) with hooks that reduce each
layer as it is computed (one extra forward per step; the same canvas and state as the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError

__all__ = ["lens_logits", "lens_trace", "LensTrace", "resid_name", "SOURCES"]

SOURCES = ("auto", "cache", "replay")
_CHUNK_BYTES = 64 * 2 ** 20  # a [rows, vocab] float32 block of lens logits stays under this


def resid_name(layer: int) -> str:
    return f"blocks.{layer}.hook_resid_post"


def check_model(model: Any) -> Any:
    from mdm_lens.model import HookedMDM

    if not isinstance(model, HookedMDM) and not callable(getattr(model, "readout", None)):
        raise ArgumentTypeError(f"model={validate.describe(model)} is not a HookedMDM (the lens reads its final norm "
                                "and unembedding) nor has a readout (HookedDDiT).", argument="model", value=model,
                                allowed="a HookedMDM or a HookedDDiT")
    return model


def lens_logits(model: Any, resid: Float[Tensor, "batch pos d_model"], layer: int, lens: Any = None
                ) -> Float[Tensor, "batch pos d_vocab"]:
    """Position-aligned lens logits of layer `layer`'s residual (`blocks.{layer}.hook_resid_post`): the tuned
    `lens`' translator (None: the logit lens, no translator), then the model's final norm and unembedding, then
    Dream's shift (`cfg.logit_shift`). At the last layer with `lens=None` this is the model's own aligned output."""
    check_model(model)
    layer = validate.index(layer, model.cfg.n_layers, name="layer", what="layer")
    # NaN in, NaN logits out would look like a lens result: refuse it here (the lens has no way to give a reason)
    validate.tensor(resid, name="resid", ndim=3, shape=(None, None, model.cfg.d_model), dtype="float", finite=True)
    if lens is not None:  # a TunedLens (not imported here: tuned.py imports this module)
        if not callable(getattr(lens, "check_model", None)) or not callable(getattr(lens, "translate", None)):
            raise ArgumentTypeError(f"lens={validate.describe(lens)} is not a TunedLens.", argument="lens",
                                    value=lens, allowed="None (logit lens) or a TunedLens")
        lens.check_model(model)
    return model.aligned_logits(_readout(model, resid, layer, lens))


def _readout(model: Any, resid: Tensor, layer: int, lens: Any) -> Tensor:
    """Raw (unshifted) lens logits of residual rows `[..., d_model]`."""
    if lens is not None:
        resid = lens.translate(resid, layer)
    if callable(getattr(model, "readout", None)):  # HookedDDiT: final norm, the step's final adaLN, unembedding
        return model.readout(resid)
    return model.unembed(model.ln_final(resid))


@dataclass
class LensTrace:
    """Per step, layer, row and answer position: the lens' top-1 token and its probability, and the final token's
    probability and rank (0 = it is the top-1; rank = how many tokens have a strictly larger logit).

    Axes `[step, layer, batch, position]`; `steps` / `layers` / `positions` name the recorded indices (positions
    are answer positions, 0 = first generated token). `masked[s, b, p]`: the position was still masked in step s's
    input (not yet decoded). `commit_step[b, p]`: the step that committed it."""

    kind: str                                      # "logit" or "tuned"
    steps: list[int]
    layers: list[int]
    positions: list[int]
    n_steps: int                                   # the run's step count
    prompt_length: int
    top1: Int[Tensor, "step layer batch pos"]
    top1_prob: Float[Tensor, "step layer batch pos"]
    final_prob: Float[Tensor, "step layer batch pos"]
    final_rank: Int[Tensor, "step layer batch pos"]
    final_tokens: Int[Tensor, "batch pos"]
    commit_step: Int[Tensor, "batch pos"]
    masked: Bool[Tensor, "step batch pos"]
    source: str = "replay"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> Bool[Tensor, "step layer batch pos"]:
        """The lens' top-1 is the final token."""
        return self.top1 == self.final_tokens[None, None]

    def accuracy(self, which: str = "masked") -> Float[Tensor, "step layer batch"]:
        """Share of answer positions whose lens top-1 is the final token, per step, layer and row: over the
        positions still masked in that step's input ("masked": known before decoded) or over all ("all"), among
        the positions the step's forward computed. NaN where the set is empty (every position already decoded)."""
        which = validate.choice(which, ("masked", "all"), name="which")
        hit = self.correct.double()
        # a cell whose forward did not compute the position (NaN probability: another block, a nemotron commit
        # forward) is no lens reading at all: left out, not counted as a miss
        sel = ((self.masked if which == "masked" else torch.ones_like(self.masked))[:, None]
               & ~torch.isnan(self.top1_prob)).double()
        n = sel.sum(-1)
        return torch.where(n > 0, (hit * sel).sum(-1) / n.clamp(min=1), torch.full_like(n, float("nan")))

    def to_frame(self) -> pd.DataFrame:
        """Tidy rows, one per (batch, step, layer, position); integer columns are pandas Int64."""
        S, L, B, P = self.top1.shape
        si, li, bi, pi = np.indices((S, L, B, P)).reshape(4, -1)
        flat = lambda t: t.detach().cpu().reshape(-1).numpy()  # noqa: E731
        df = pd.DataFrame({
            "batch": bi, "step": np.asarray(self.steps)[si], "layer": np.asarray(self.layers)[li],
            "position": np.asarray(self.positions)[pi], "top1": flat(self.top1),
            "top1_prob": flat(self.top1_prob).astype(float), "final_token": self.final_tokens.numpy()[bi, pi],
            "final_prob": flat(self.final_prob).astype(float), "final_rank": flat(self.final_rank),
            "correct": flat(self.correct), "masked": self.masked.numpy()[si, bi, pi],
            "commit_step": self.commit_step.numpy()[bi, pi]})
        for c in ("batch", "step", "layer", "position", "top1", "final_token", "final_rank", "commit_step"):
            df[c] = df[c].astype("Int64")
        return df

    def __repr__(self) -> str:
        S, L, B, P = self.top1.shape
        acc = self.accuracy("all")[:, -1].nanmean().item() if S else float("nan")
        return (f"LensTrace({self.kind} lens, steps={S}/{self.n_steps}, layers={self.layers}, batch={B}, "
                f"positions={P}; layer {self.layers[-1]}'s top-1 = final token on {acc:.0%} of (step, position); "
                f"source={self.source})")


# --- reduction ----------------------------------------------------------------------------------------

def reduce_logits(logits: Float[Tensor, "rows d_vocab"], target: Int[Tensor, "rows"]
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(top-1 id, top-1 prob, target prob, target rank) of each row, in float32."""
    logits = logits.float()
    logp = logits.log_softmax(-1)
    top_logp, top1 = logp.max(-1)
    tgt_logit = logits.gather(-1, target[:, None])
    rank = (logits > tgt_logit).sum(-1)
    return top1, top_logp.exp(), logp.gather(-1, target[:, None])[:, 0].exp(), rank


def _rows_per_chunk(model: Any) -> int:
    return max(1, _CHUNK_BYTES // (4 * model.cfg.d_vocab))


def reduce_layer(model: Any, resid: Float[Tensor, "batch pos d_model"], layer: int, lens: Any, src: Tensor,
                 target: Tensor) -> tuple[Tensor, ...]:
    """Reduce layer `layer`'s lens at the absolute source rows `src` ([P]: the residual rows whose raw logits are
    the aligned predictions of the answer positions) against `target` ([batch, P]); chunked over rows so only a
    `[chunk, vocab]` block of logits exists at a time. Returns four `[batch, P]` tensors."""
    rows = resid[:, src].reshape(-1, resid.shape[-1])
    tgt = target.reshape(-1).to(rows.device)
    step = _rows_per_chunk(model)
    parts = [reduce_logits(_readout(model, rows[i:i + step], layer, lens), tgt[i:i + step])
             for i in range(0, rows.shape[0], step)]
    return tuple(torch.cat([p[k] for p in parts]).reshape(target.shape).cpu() for k in range(4))


# --- the trace ----------------------------------------------------------------------------------------
