"""Input checks and output parameterisations of the DDiT families (MDLM's SUBS, Duo's log-softmax)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens import inputs, validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import InputError
from mdm_lens.precision import compute_dtype

RETURN_TYPES = ("logits", "aligned", "log_probs", "subs", "log_softmax", None)
LENGTH_KEY = {"gidd": "max_seq_len"}  # the config.json key of n_ctx where it is not `model_length`
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
        key = LENGTH_KEY.get(cfg.family, "model_length")
        raise InputError(f"tokens have {tokens.shape[1]} positions; this model's length ({key} in its config.json) is "
                         f"{cfg.n_ctx}.", argument="tokens", value=tuple(tokens.shape), allowed=f"pos <= {cfg.n_ctx}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.d_vocab):
        raise InputError(f"token ids must lie in [0, {cfg.d_vocab}); got min {int(tokens.min())}, max "
                         f"{int(tokens.max())}.", argument="tokens", value=tokens, allowed=f"[0, {cfg.d_vocab})")
    if attention_mask is not None:
        # the checks HookedMDM applies (a tensor, 0/1 values of an int / bool / float dtype, the tokens' shape):
        # an all-ones mask of the wrong shape or values is a caller's mistake even when it pads nothing
        attention_mask = inputs.attention_mask(attention_mask, tokens, cfg)
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise InputError("attention_mask with padding: DDiT models attend to every position (the references have no "
                         "padding mask); pass unpadded rows.", argument="attention_mask", value=attention_mask,
                         allowed="None or all ones")
    return tokens


def sigma_tensor(sigma: Any) -> Tensor:
    """A number (numpy scalars included) as a 0-d tensor; a tensor as is; anything else a typed error naming
    both accepted forms (the σ / t of every DDiT family)."""
    import numbers

    if isinstance(sigma, numbers.Real) and not isinstance(sigma, bool):
        return torch.tensor(float(sigma))
    if not isinstance(sigma, Tensor):
        from mdm_lens.errors import ArgumentTypeError

        raise ArgumentTypeError(f"sigma={validate.describe(sigma)} is invalid: expected a number or a float tensor of "
                                "shape [] or [batch].", argument="sigma", value=sigma,
                                allowed="a number, or a float tensor [] / [batch]")
    return sigma


def warn_sigma_ignored(model: Any) -> None:
    """A `sigma=` passed by hand to a model whose network zeroes σ (`time_conditioning` off, as the reference)
    changes nothing: said once per model, as `noise_level` says it (a sampler's own σ, under `model.state`, is
    not a user's choice and is not warned about)."""
    if getattr(model, "_sigma_warned", False):
        return
    model._sigma_warned = True
    import warnings

    warnings.warn(f"{model.cfg.model_name}: time_conditioning is off, so the network zeroes σ and sigma= has no "
                  "effect on the logits (as in the reference); use a time-conditioned checkpoint to vary it.",
                  UserWarning, stacklevel=5)  # past forward and nn.Module.__call__


def check_sigma(sigma: Any, batch: int, cfg: MDMConfig, device: torch.device) -> Float[Tensor, "batch"]:
    """σ as a `[batch]` tensor in fp32 (float64 for a float64 model, `mdm_lens.precision`): a number or 0-d tensor
    is broadcast; finite and ≥ 0."""
    if sigma is None:
        if cfg.extra["time_conditioning"]:
            raise InputError(f"sigma is required: this {cfg.family} model is time-conditioned (pass sigma=… per batch "
                             "row, e.g. −log α_t).", argument="sigma", value=None, allowed="a number or [batch] tensor")
        return torch.zeros(batch, device=device, dtype=compute_dtype(cfg.dtype))
    sigma = validate.tensor(sigma_tensor(sigma), name="sigma", ndim=(0, 1), dtype="float")
    if sigma.ndim == 1 and sigma.shape[0] not in (1, batch):
        raise InputError(f"sigma has {sigma.shape[0]} entries for a batch of {batch}.", argument="sigma",
                         value=tuple(sigma.shape), allowed=f"a number, [1] or [{batch}]")
    if not bool(torch.isfinite(sigma).all()) or bool((sigma < 0).any()):
        raise InputError(f"sigma={sigma.tolist()} must be finite and >= 0.", argument="sigma", value=sigma,
                         allowed="finite values >= 0")
    return sigma.to(device=device, dtype=compute_dtype(cfg.dtype)).reshape(-1).expand(batch).contiguous()


TIME_WORDS = ("t", "time", "timestep", "timesteps", "noise_level", "alpha", "alpha_t")


def refuse_keywords(unknown: dict[str, Any], accepted: tuple[str, ...], cfg: MDMConfig) -> None:
    """A typed error for keywords a DDiT forward does not take (Python's would be a bare TypeError), naming the
    nearest accepted one; a time-like keyword is pointed to `sigma`, the one conditioning input."""
    if not unknown:
        return
    import difflib

    name = next(iter(unknown))
    if name in TIME_WORDS:
        hint = ("GIDD is conditioned on the time itself: pass sigma=t (in [0, 1])" if cfg.family == "gidd" else
                f"the {cfg.family} network reads the noise level σ, not the time: pass sigma= (log-linear schedule: "
                "σ = −log(1 − (1 − 1e-3)·t); Duo: −log α_t)")
    else:
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}=?" if close else f"it takes {', '.join(accepted)}"
    raise InputError(f"{name}={validate.describe(unknown[name])} is not a keyword of this {cfg.family} forward: "
                     f"{hint}.", argument=name, value=unknown[name], allowed=", ".join(accepted))
