"""MDLM's `analytic` predictor (the score-based τ-leaping update of SEDD, specialised to the absorbing state) and its
`_denoiser_update` noise removal, as pure functions of the SUBS log-probs (families-2.md §2.7).

With s the concrete score ratio p_t(y)/p_t(x) and k = e^{−σ}/(1 − e^{−σ}) (σ the *unzeroed* total noise, even when
the network ignores σ):
  masked rows   s(y) = p_θ(y)·k for y ≠ mask, s(mask) = 1
  unmasked rows s(x) = 1, s(mask) = 1/k, s(y) = e^{−1e6} (= 0) elsewhere
the staggered score multiplies s by e^{dσ} and adds (1 − e^{dσ})·Σ_y s(y) to the mask column, and the transposed
transition is e^{−dσ}·onehot(x) + [x = mask]·(1 − e^{−dσ}). Their product is drawn with the Gumbel-max draw; an
unmasked row has mass only on its own token, so committed tokens (and the prompt) never move."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens.ddit.outputs import NEG_INFINITY


def score(log_p: Float[Tensor, "batch pos d_vocab"], x: Int[Tensor, "batch pos"], sigma: Float[Tensor, "batch"],
          mask_id: int) -> Float[Tensor, "batch pos d_vocab"]:
    """`Diffusion.get_score` on SUBS log-probs: the concrete score, exponentiated."""
    log_k = -torch.log(torch.expm1(sigma))[:, None, None]
    masked_score = log_p + log_k
    masked_score[:, :, mask_id] = 0
    unmasked_score = torch.full_like(log_p, NEG_INFINITY).scatter(-1, x[..., None], 0.0)
    unmasked_score[:, :, mask_id] = -log_k[:, :, 0].expand_as(x)
    # the reference mixes the two by multiplying with the 0/1 mask indicator (not `where`): kept for exactness
    m = (x == mask_id).to(log_p.dtype)[:, :, None]
    return (masked_score * m + unmasked_score * (1 - m)).exp()


def staggered(s: Float[Tensor, "batch pos d_vocab"], dsigma: Float[Tensor, "batch"], mask_id: int
              ) -> Float[Tensor, "batch pos d_vocab"]:
    e = dsigma.exp()
    extra = (1 - e)[:, None] * s.sum(dim=-1)
    s = s * e[:, None, None]
    s[..., mask_id] += extra
    return s


def transposed_transition(x: Int[Tensor, "batch pos"], sigma: Float[Tensor, "batch"], d_vocab: int, mask_id: int
                          ) -> Float[Tensor, "batch pos d_vocab"]:
    decay = torch.exp(-sigma)
    edge = decay[:, None, None] * torch.nn.functional.one_hot(x, num_classes=d_vocab)
    return edge + torch.where(x == mask_id, (1 - decay)[:, None], 0)[..., None]


def analytic_probs(log_p: Tensor, x: Tensor, sigma_t: Tensor, dsigma: Tensor, mask_id: int) -> Tensor:
    """`_analytic_update`'s unnormalised categorical (dsigma = σ_t − σ_s)."""
    s = staggered(score(log_p, x, sigma_t, mask_id), dsigma, mask_id)
    return s * transposed_transition(x, dsigma, log_p.shape[-1], mask_id)


def denoiser_probs(log_p: Tensor, x: Tensor, sigma: Tensor, mask_id: int) -> Tensor:
    """`_denoiser_update`'s categorical: the analytic step all the way to σ = 0, the mask column removed."""
    probs = analytic_probs(log_p, x, sigma, sigma, mask_id)
    probs[..., mask_id] = 0
    return probs
