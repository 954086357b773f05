"""Which canvas positions a denoising step still has to predict ("masked"), for models with and without a mask token.

Masked diffusion (LLaDA, MDLM, ...): the positions holding the mask id. Uniform-state diffusion (Duo): there is no
[MASK]; every generated position holds a token drawn from the noise and the ancestral sampler may resample it at
any step until the last, so "masked" there means every generated position (the ones not in the prompt), and an
anchor null must be the z-score over visible keys, not a mask-embedding shortcut. Hybrid diffusion (GIDD with
`p_uniform` > 0): the [MASK] positions and every generated position — the hybrid posterior may move any generated
token (to [MASK] or to another token) at every step, so none is final before the run ends."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

UNIFORM_STATE_NOTE = ("uniform-state model (no [MASK] token): 'masked' means the generated positions, which still "
                      "hold noise the sampler may resample until its last step (none is committed before the end); "
                      "the anchor null is the z-score over visible keys, not a mask-embedding shortcut")

HYBRID_NOTE = ("hybrid mask/uniform model (GIDD, p_uniform > 0): 'masked' means the positions holding [MASK] and every "
               "generated position, which the sampler redraws at every step until its last (a token that is not "
               "[MASK] may still change); the prompt is never noisy")


def is_hybrid(cfg: Any) -> bool:
    """GIDD with a uniform-noise share (`p_uniform` > 0); at 0 its uniform part is clipped to e^-20 and it is read
    as masked diffusion."""
    return cfg.family == "gidd" and float(cfg.extra.get("p_uniform", 0.0)) > 0


def hybrid_noisy(x: Int[Tensor, "... pos"], prompt: Bool[Tensor, "... pos"], mask_id: int,
                 p_uniform: float) -> Bool[Tensor, "... pos"]:
    """GIDD's noisy positions: [MASK], and with `p_uniform` > 0 every position outside the prompt."""
    noisy = x == mask_id
    return noisy | ~prompt if p_uniform > 0 else noisy


def noisy_positions(cfg: Any, x: Int[Tensor, "... pos"], prompt_length: int) -> Bool[Tensor, "... pos"]:
    """`x == mask id`; on a model without one, every position at or after `prompt_length`; on a hybrid model
    (`is_hybrid`) both."""
    generated = (torch.arange(x.shape[-1], device=x.device) >= prompt_length).expand_as(x).clone()
    if cfg.mask_token_id is None:
        return generated
    if is_hybrid(cfg):
        return hybrid_noisy(x, ~generated, cfg.mask_token_id, cfg.extra["p_uniform"])
    return x == cfg.mask_token_id


def notes_for(cfg: Any) -> list[str]:
    """The note a probe result carries on a model without a mask token or a hybrid one (empty otherwise)."""
    if is_hybrid(cfg):
        return [HYBRID_NOTE]
    return [UNIFORM_STATE_NOTE] if cfg.mask_token_id is None and cfg.attention != "causal" else []
