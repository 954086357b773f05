"""Which canvas positions a denoising step still has to predict ("masked"), for models with and without a mask token.

Masked diffusion (LLaDA, MDLM, ...): the positions holding the mask id. Uniform-state diffusion (Duo): there is no
[MASK]; every generated position holds a token drawn from the noise and the ancestral sampler may resample it at
any step until the last, so "masked" there means every generated position (the ones not in the prompt), and an
anchor null must be the z-score over visible keys, not a mask-embedding shortcut."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

UNIFORM_STATE_NOTE = ("uniform-state model (no [MASK] token): 'masked' means the generated positions, which still "
                      "hold noise the sampler may resample until its last step (none is committed before the end); "
                      "the anchor null is the z-score over visible keys, not a mask-embedding shortcut")


def noisy_positions(cfg: Any, x: Int[Tensor, "... pos"], prompt_length: int) -> Bool[Tensor, "... pos"]:
    """`x == mask id`; on a model without one, every position at or after `prompt_length`."""
    if cfg.mask_token_id is not None:
        return x == cfg.mask_token_id
    return (torch.arange(x.shape[-1], device=x.device) >= prompt_length).expand_as(x).clone()


def notes_for(cfg: Any) -> list[str]:
    """The note a probe result carries on a model without a mask token (empty otherwise)."""
    return [UNIFORM_STATE_NOTE] if cfg.mask_token_id is None and cfg.attention != "causal" else []
