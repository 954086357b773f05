"""GIDD DiT models (`dvruette/gidd-{small,base}-p_unif-*`, families-2.md §5.1) on the DDiT core: `HookedGIDD`,
and the hybrid mask/uniform noise of `HybridDiffusion` that its sampler and the noise-level probe read.

The network is the DDiT core conditioned on the diffusion time t ∈ [0, 1] (not σ): pass it as `sigma=t`. Positions
are 0..L−1 for any L ≤ `max_seq_len` — flash-attn's semantics; the reference's torch path slices its cached cos/sin
on the wrong axis (trap T1.3) and only runs at L == max_seq_len, where both agree. Output: raw logits; its
parameterisation ("log_probs") sets the [MASK] logit to −1e6 (what `GiddSampler` does) and normalises."""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.ddit.model import FORWARD_KEYWORDS, HookedDDiT
from mdm_lens.ddit.outputs import refuse_keywords, sigma_tensor
from mdm_lens.errors import InputError

CLIP_NOISE = 20.0  # HybridDiffusion(clip_noise=20, gamma=1)
MASK_LOGIT = -1e6


def gidd_log_probs(logits: Float[Tensor, "batch pos d_vocab"], mask_id: int) -> Float[Tensor, "batch pos d_vocab"]:
    out = logits.clone()
    out[..., mask_id] = MASK_LOGIT
    return torch.log_softmax(out, dim=-1)


class HybridNoise:
    """`HybridDiffusion(p_uniform)`: α_t = (1−t)/C_t and βπ_t = (t·e_mask + c_t·u)/C_t with c_t = B·√(t(1−t)),
    C_t = max(1 + c_t, 1e-4), u uniform over the non-mask ids, log B = ln 2 + ln p_u − ln(1 − p_u) clipped at −20
    (float32 like the reference's buffers)."""

    def __init__(self, d_vocab: int, mask_id: int, p_uniform: float):
        p_u = max(math.exp(-CLIP_NOISE), float(p_uniform))
        log_b = math.log(2) + math.log(p_u) - math.log(1 - p_u)
        self.log_b = torch.tensor(float(log_b)).clip(-CLIP_NOISE)
        self.mask = torch.zeros(d_vocab)
        self.mask[mask_id] = 1
        self.unif = (1 - self.mask) / (d_vocab - 1)

    def alpha_betapi(self, t: Float[Tensor, "n"]) -> tuple[Tensor, Tensor]:
        """(α_t `[n, 1]`, βπ_t `[n, d_vocab]`) for times `[n]`."""
        t = t[:, None]
        gamma = torch.tensor(1.0)
        c_t = t.pow(gamma / 2) * (1 - t).pow(gamma / 2) * self.log_b.exp()
        big_c = (1 + c_t).clip(1e-4)
        return (1 - t) / big_c, (t * self.mask.to(t.device) + c_t * self.unif.to(t.device)) / big_c

    def probs_at_t(self, p: Tensor, t: Tensor) -> Tensor:
        alpha, betapi = self.alpha_betapi(t)
        out = p * alpha[..., None]
        out[..., :betapi.shape[-1]] += betapi[:, None]
        return out.to(p.dtype)


class HookedGIDD(HookedDDiT):
    """GIDD-DiT with TL hook points (the `HookedDDiT` surface). `cfg.extra`: p_uniform, t_eps. `hook_sigma` sees t."""

    families = ("gidd",)

    @classmethod
    def load_family(cls, folder: Any, family: str, name: str, **kwargs: Any) -> "HookedGIDD":
        """A GIDD-DiT hub folder into this class (`mdm_lens.ddit.hub.load_hub`)."""
        from mdm_lens.ddit.hub import load_hub

        return load_hub(cls, folder, family, name, **kwargs)

    def noise(self) -> HybridNoise:
        return HybridNoise(self.cfg.d_vocab, self.cfg.mask_token_id, self.cfg.extra["p_uniform"])

    def forward(self, tokens: Any, sigma: Any = None, return_type: str | None = "logits",
                attention_mask: Tensor | None = None, **unknown: Any) -> Any:
        """Logits at diffusion time t (`sigma=t`, a number or `[batch]` tensor in [0, 1]; omitted: `step_sigma()`,
        the running step's t, else the clean-data time t_eps).

        return_type: "logits" / "aligned" (raw), "log_probs" / "gidd" (mask logit −1e6, log-softmax),
        "log_softmax" (plain), or None. "subs" is MDLM's and is refused."""
        refuse_keywords(unknown, FORWARD_KEYWORDS, self.cfg)  # `t=` names sigma=t
        kinds = ("logits", "aligned", "log_probs", "gidd", "log_softmax", None)
        return_type = validate.choice(return_type, kinds, name="return_type")
        sigma = self.step_sigma() if sigma is None else sigma
        t = sigma_tensor(sigma)
        if bool((t > 1).any()):
            raise InputError(f"sigma={t.tolist()}: GIDD's conditioning is the time t in [0, 1].", argument="sigma",
                             value=sigma, allowed="values in [0, 1]")
        if return_type in ("log_probs", "gidd"):
            return gidd_log_probs(super().forward(tokens, sigma, "logits", attention_mask), self.cfg.mask_token_id)
        return super().forward(tokens, sigma, return_type, attention_mask)

    def step_sigma(self) -> Tensor | float:
        """The t a forward (or `readout`) without `sigma` takes: the running step's (`model.state.extra["sigma"]`,
        set by `GiddSampler`, a replay, `out.at_step`); outside a step the clean-data time `t_eps` (the sampler's
        last grid time): what the probes' clean forwards of a final sequence are conditioned on."""
        state_t = None if self.state is None else self.state.extra.get("sigma")
        return float(self.cfg.extra["t_eps"]) if state_t is None else state_t

    def __repr__(self) -> str:
        return super().__repr__().replace("HookedDDiT(", "HookedGIDD(", 1)[:-1] + \
            f", p_uniform={self.cfg.extra['p_uniform']})"
