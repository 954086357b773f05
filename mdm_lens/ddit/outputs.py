"""Input checks and output parameterisations of the DDiT families (MDLM's SUBS, Duo's log-softmax)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import InputError

RETURN_TYPES = ("logits", "aligned", "log_probs", "subs", "log_softmax", None)
NEG_INFINITY = -1000000.0  # the reference's `neg_infinity` constant (a finite stand-in for −inf)


def subs(logits: Float[Tensor, "batch pos d_vocab"], xt: Int[Tensor, "batch pos"], mask_id: int
         ) -> Float[Tensor, "batch pos d_vocab"]:
    """MDLM's SUBS parameterisation (`Diffusion._subs_parameterization`): never predict the mask, normalise, and
    copy unmasked tokens (log-prob 0 at their own id, −1e6 elsewhere)."""
    logits = logits.clone()
    logits[:, :, mask_id] += NEG_INFINITY
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked = xt != mask_id
    logits[unmasked] = NEG_INFINITY
    logits[unmasked, xt[unmasked]] = 0
    return logits


def finish(raw: Tensor, tokens: Tensor, return_type: str, cfg: MDMConfig) -> Tensor:
    if return_type in ("logits", "aligned"):
        return raw
    kind = cfg.extra["parameterization"] if return_type == "log_probs" else return_type
    if kind == "subs":
        if cfg.mask_token_id is None:
            raise InputError(f"return_type={return_type!r}: SUBS needs a mask token and this {cfg.family} model has "
                             "none.", argument="return_type", value=return_type, allowed="'logits' or 'log_softmax'")
        return subs(raw, tokens, cfg.mask_token_id)
    return torch.log_softmax(raw, dim=-1)


def check_tokens(tokens: Any, cfg: MDMConfig, attention_mask: Any) -> Tensor:
    tokens = validate.tensor(tokens, name="tokens", ndim=2, dtype="int")
    if tokens.shape[1] > cfg.n_ctx:
        raise InputError(f"tokens have {tokens.shape[1]} positions; this model's length (model_length) is "
                         f"{cfg.n_ctx}.", argument="tokens", value=tuple(tokens.shape), allowed=f"pos <= {cfg.n_ctx}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.d_vocab):
        raise InputError(f"token ids must lie in [0, {cfg.d_vocab}); got min {int(tokens.min())}, max "
                         f"{int(tokens.max())}.", argument="tokens", value=tokens, allowed=f"[0, {cfg.d_vocab})")
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        raise InputError("attention_mask with padding: DDiT models attend to every position (the references have no "
                         "padding mask); pass unpadded rows.", argument="attention_mask", value=attention_mask,
                         allowed="None or all ones")
    return tokens


def check_sigma(sigma: Any, batch: int, cfg: MDMConfig, device: torch.device) -> Float[Tensor, "batch"]:
    """σ as a float32 `[batch]` tensor: a number or 0-d tensor is broadcast; finite and ≥ 0."""
    if sigma is None:
        if cfg.extra["time_conditioning"]:
            raise InputError(f"sigma is required: this {cfg.family} model is time-conditioned (pass sigma=… per batch "
                             "row, e.g. −log α_t).", argument="sigma", value=None, allowed="a number or [batch] tensor")
        return torch.zeros(batch, device=device)
    if isinstance(sigma, (int, float)) and not isinstance(sigma, bool):
        sigma = torch.tensor(float(sigma))
    sigma = validate.tensor(sigma, name="sigma", ndim=(0, 1), dtype="float")
    if sigma.ndim == 1 and sigma.shape[0] not in (1, batch):
        raise InputError(f"sigma has {sigma.shape[0]} entries for a batch of {batch}.", argument="sigma",
                         value=tuple(sigma.shape), allowed=f"a number, [1] or [{batch}]")
    if not bool(torch.isfinite(sigma).all()) or bool((sigma < 0).any()):
        raise InputError(f"sigma={sigma.tolist()} must be finite and >= 0.", argument="sigma", value=sigma,
                         allowed="finite values >= 0")
    return sigma.to(device=device, dtype=torch.float32).reshape(-1).expand(batch).contiguous()
