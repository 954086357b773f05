"""Training-objective losses for `HookedMDM.forward(..., return_type="loss" | "both")`.

Masked diffusion models (`cfg.attention != "causal"`): the loss of a *given* masked canvas is the cross-entropy
of the clean `targets` at the positions where the input holds the mask token (`cfg.mask_token_id`), read from the
position-aligned logits (logit i predicts token i; Dream-style `cfg.logit_shift` models read hidden state i-1).
Positions that are not scored: unmasked ones, padding (`attention_mask == 0`), and, for shifted models, a
position whose predecessor is padding or does not exist (position 0): no hidden state predicts it.

    weighting="none"  loss = mean over scored positions of CE(logits_i, targets_i)          (token mean, as TL)
    weighting="1/t"   LLaDA's pre-training objective (GUIDELINES.md of ML-GSAI/LLaDA):
                      loss = Σ_rows Σ_{i scored} CE_i / p_mask_row  /  Σ_rows L_row
                      with p_mask the probability each token was masked with (the `(1-ε)t + ε` of
                      `forward_process`) and L_row the row's real (non-pad) length; with no padding the
                      denominator is the reference's B·L. `p_mask` must be given: it is a fact of how the
                      canvas was noised, not something the canvas reveals.

Autoregressive twins (`cfg.attention == "causal"`): TransformerLens' next-token loss, logit i scored against
`targets[i+1]` (`targets` defaults to the tokens), pairs touching padding excluded; per-token shape `[batch, pos-1]`.

Undefined values are NaN, never 0: a position that is not scored is NaN in `loss_per_token=True` output, and a
batch with no scored position gives a NaN loss with an `UndefinedLossWarning` saying why.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import InputError, InputTypeError
from mdm_lens.inputs import like_tokens

Weighting = Literal["none", "1/t"]
LOSS_RETURN_TYPES = ("loss", "both")


class UndefinedLossWarning(UserWarning):
    """The loss is NaN because nothing was scored (no masked position, or only padding)."""


def _targets(targets: Any, tokens: Tensor) -> Int[Tensor, "batch pos"]:
    if not isinstance(targets, Tensor):
        raise InputTypeError(f"targets={validate.describe(targets)} is invalid: expected an integer tensor "
                             f"{list(tokens.shape)} of clean token ids.", argument="targets", value=targets,
                             allowed="an integer tensor [batch, pos]")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise InputTypeError(f"targets has dtype {targets.dtype}; expected integer token ids.", argument="targets",
                             value=targets, allowed="an integer tensor")
    targets = like_tokens(targets, tokens, "targets", "one clean token per input position")
    return targets.to(device=tokens.device, dtype=torch.long)


def _check_ids(targets: Tensor, real: Tensor, cfg: MDMConfig, refuse_mask: bool) -> None:
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= cfg.d_vocab:
        raise InputError(f"targets must lie in [0, {cfg.d_vocab}), got range [{lo}, {hi}].", argument="targets",
                         value=targets, allowed=f"ids in [0, {cfg.d_vocab})")
    mask_id = cfg.mask_token_id
    if refuse_mask and mask_id is not None:
        bad = ((targets == mask_id) & real).nonzero().tolist()
        if bad:
            raise InputError(f"targets hold the mask token id {mask_id} at (row, position) {tuple(bad[0])} "
                             f"({len(bad)} place(s)): targets are the clean tokens, which never contain the mask.",
                             argument="targets", value=targets, allowed=f"clean ids (not {mask_id})")


def _p_mask(p_mask: Any, weighting: str, batch: int, device: torch.device) -> Float[Tensor, "batch"] | None:
    if weighting == "none":
        if p_mask is not None:
            raise InputError("p_mask is only used by weighting='1/t'; drop it or set weighting='1/t'.",
                             argument="p_mask", value=p_mask, allowed="None with weighting='none'")
        return None
    if p_mask is None:
        raise InputError("weighting='1/t' needs p_mask=, the probability each token of a row was masked with "
                         "(LLaDA: (1-1e-3)·t + 1e-3), a float or a [batch] tensor in (0, 1].", argument="p_mask",
                         value=None, allowed="a float or [batch] tensor in (0, 1]")
    if isinstance(p_mask, numbers.Real) and not isinstance(p_mask, bool):
        p_mask = torch.full((batch,), float(p_mask))
    p = validate.tensor(p_mask, name="p_mask", dtype="float", finite=True)
    if p.ndim == 0:
        p = p.expand(batch)
    if tuple(p.shape) != (batch,):
        raise InputError(f"p_mask shape {tuple(p.shape)} must be [] or [{batch}] (one rate per row).",
                         argument="p_mask", value=p, allowed=f"shape [{batch}]")
    if bool(((p <= 0) | (p > 1)).any()):
        raise InputError(f"p_mask must lie in (0, 1], got range [{float(p.min())}, {float(p.max())}].",
                         argument="p_mask", value=p, allowed="values in (0, 1]")
    return p.to(device=device, dtype=torch.float64)


@dataclass
class LossRequest:
    """A checked loss request (everything validated before the forward runs); `compute` turns logits into it."""

    cfg: MDMConfig
    tokens: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    real: Bool[Tensor, "batch pos"]
    per_token: bool
    p_mask: Float[Tensor, "batch"] | None

    @property
    def causal(self) -> bool:
        return self.cfg.attention == "causal"

    def scored(self) -> Bool[Tensor, "batch pos"]:
        """MDM: the positions whose CE enters the loss (module docstring)."""
        scored = (self.tokens == self.cfg.mask_token_id) & self.real
        if self.cfg.logit_shift:  # position i is read from hidden state i-1, which must exist and be real
            has_source = torch.zeros_like(scored)
            has_source[:, 1:] = self.real[:, :-1]
            scored = scored & has_source
        return scored

    def compute(self, raw: Float[Tensor, "batch pos d_vocab"], aligned: Float[Tensor, "batch pos d_vocab"]) -> Tensor:
        """The loss from the forward's raw logits (ARM: TL's next-token pairing) or its position-aligned ones (MDM)."""
        return self._next_token(raw) if self.causal else self._masked(aligned)

    def _ce(self, logits: Tensor, targets: Tensor) -> Tensor:
        # half-precision logits are scored in fp32 (a bf16 log-softmax loses ~3 digits); float64 stays float64
        log_probs = F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
        return -log_probs.gather(-1, targets[..., None])[..., 0]

    def _reduce(self, ce: Tensor, scored: Tensor, denominator: Tensor, what: str) -> Tensor:
        per_token = ce.masked_fill(~scored, float("nan"))
        if self.per_token:
            return per_token
        if not bool(scored.any()):
            warnings.warn(f"the loss is NaN: {what}", UndefinedLossWarning, stacklevel=4)
        total = torch.where(scored, ce, torch.zeros_like(ce)).sum()  # where, not masked_fill: NaN-free gradients
        return total / denominator if bool(scored.any()) else total * float("nan")

    def _masked(self, logits: Tensor) -> Tensor:
        scored = self.scored()
        ce = self._ce(logits, self.targets)
        if self.p_mask is not None:
            ce = ce / self.p_mask[:, None].to(ce.dtype)
            denominator = self.real.sum()
        else:
            denominator = scored.sum()
        why = (f"no position of the input is the mask token {self.cfg.mask_token_id}"
               + (" with a real predecessor (shifted logits)" if self.cfg.logit_shift else "")
               + " outside padding, so there is nothing to score.")
        return self._reduce(ce, scored, denominator, why)

    def _next_token(self, logits: Tensor) -> Tensor:
        scored = self.real[:, :-1] & self.real[:, 1:]
        ce = self._ce(logits[:, :-1], self.targets[:, 1:])
        return self._reduce(ce, scored, scored.sum(), "no (position, next position) pair of real tokens: a "
                            "next-token loss needs at least two real tokens in a row.")


def request(return_type: Any, cfg: MDMConfig, tokens: Tensor, attention_mask: Tensor | None, targets: Any,
            loss_per_token: Any, weighting: Any, p_mask: Any) -> LossRequest | None:
    """Check the loss arguments of a forward call; None when `return_type` asks for no loss (and then none of
    them may be set: they would be silently ignored)."""
    per_token = validate.boolean(loss_per_token, name="loss_per_token")
    weighting = validate.choice(weighting, ("none", "1/t"), name="weighting", error=InputError)
    if return_type not in LOSS_RETURN_TYPES:
        given = [n for n, unset in (("targets", targets is None), ("loss_per_token", not per_token),
                                    ("weighting", weighting == "none"), ("p_mask", p_mask is None)) if not unset]
        if given:
            raise InputError(f"{given[0]} is only used with return_type='loss' or 'both' (got "
                             f"return_type={return_type!r}).", argument=given[0], value=return_type,
                             allowed="return_type='loss' or 'both'")
        return None
    causal = cfg.attention == "causal"
    if not causal and cfg.mask_token_id is None:
        raise InputError("a masked-diffusion loss needs cfg.mask_token_id (which positions are masked); this "
                         "model has none.", argument="return_type", value=return_type, allowed="'logits'")
    if targets is None:
        if not causal:
            raise InputError("return_type='loss' on a masked diffusion model needs targets=, the clean tokens "
                             "[batch, pos] behind the masked input.", argument="targets", value=None,
                             allowed="an integer tensor [batch, pos]")
        targets = tokens
    if causal and weighting != "none":
        raise InputError("weighting='1/t' is the masked-diffusion objective; an autoregressive model's loss is "
                         "next-token CE.", argument="weighting", value=weighting, allowed="'none'")
    targets = _targets(targets, tokens)
    real = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    _check_ids(targets, real, cfg, refuse_mask=not causal)
    return LossRequest(cfg, tokens, targets, real, per_token, _p_mask(p_mask, weighting, tokens.shape[0],
                                                                      tokens.device))
