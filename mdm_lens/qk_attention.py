"""Attention and blocks of the 2026 families: per-head q/k RMSNorm, partial rotary, q/k/v clipping, an
output bias, and dense-or-MoE feed-forward layers. `make_block` picks the block for a layer.

Which options apply comes from `cfg.extra` (written by the loaders in `mdm_lens.loading`):
`arch` (llada2_moe | lladamoe | sdar | sdar_moe | nemotron_dllm | rnd1 | coda), `qk_norm`, `rotary_dim` (the
first dims of each head are rotated, rotate-half style, the rest pass through), `clip_qkv`, `o_bias`, `moe` (see `mdm_lens.moe`)
and `moe_layers` (one bool per layer).

Order inside attention, as in the references: `hook_q/hook_k/hook_v` (projections) → q/k norm
(`hook_q_normed`/`hook_k_normed`) → clamp to ±clip_qkv (LLaDA-MoE; v is clamped after `hook_v`) → rotary
(`hook_rot_q`/`hook_rot_k`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.components import Attention, Block, GatedMLP, RMSNorm, apply_rotary
from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.moe import MoEMLP
from mdm_lens.precision import at_least_fp32
from mdm_lens.rotary import QScaledCos

FAMILY_ARCHES = ("llada2_moe", "lladamoe", "sdar", "sdar_moe", "nemotron_dllm", "rnd1", "coda")


class HeadRMSNorm(nn.Module):
    """RMSNorm over `d_head`, one weight shared by all heads (`attn.q_norm.w`, `attn.k_norm.w`)."""

    def __init__(self, d_head: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_head, dtype=dtype))

    def forward(self, x: Float[Tensor, "batch pos head d_head"]) -> Float[Tensor, "batch pos head d_head"]:
        x32 = at_least_fp32(x)  # fp32, float64 for float64 (mdm_lens.precision)
        return self.w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class FamilyAttention(Attention):
    """`Attention` plus the options above; the TL weight views (`W_Q`, …, `b_O`) and the output bias's addition
    are the base class's."""

    def __init__(self, cfg: MDMConfig):
        super().__init__(cfg)
        extra = cfg.extra
        self.rotary_dim = int(extra.get("rotary_dim") or cfg.d_head)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= cfg.d_head:
            raise ConfigError(f"rotary_dim={self.rotary_dim} (head_dim · partial_rotary_factor) must be even and in "
                              f"(0, d_head={cfg.d_head}].")
        self.clip_qkv = extra.get("clip_qkv")
        self.q_norm = HeadRMSNorm(cfg.d_head, cfg.norm_eps, cfg.dtype) if extra.get("qk_norm") else None
        self.k_norm = HeadRMSNorm(cfg.d_head, cfg.norm_eps, cfg.dtype) if extra.get("qk_norm") else None
        self.o_bias = nn.Parameter(torch.zeros(cfg.d_model, dtype=cfg.dtype)) if extra.get("o_bias") else None
        if self.q_norm is not None:  # only where they fire
            self.hook_q_normed = HookPoint()  # [batch, pos, head, d_head], after the q norm
            self.hook_k_normed = HookPoint()  # [batch, pos, kv_head, d_head]

    def _rotate_part(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        full = self.cfg.rope_full_precision
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, cos, sin, full)
        r = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin, full), x[..., r:]], dim=-1)

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q_scale = None
        if isinstance(cos, QScaledCos):  # llama-4 query scale (Nemotron-Labs-Diffusion): after q's rotation
            cos, q_scale = cos
        if self.q_norm is not None:
            q = self.hook_q_normed(self.q_norm(q))
            k = self.hook_k_normed(self.k_norm(k))
        if self.clip_qkv is not None:
            c = float(self.clip_qkv)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = self._rotate_part(q, cos, sin)
        if q_scale is not None:
            q = q * q_scale.to(q.dtype)
        return self.hook_rot_q(q), self.hook_rot_k(self._rotate_part(k, cos, sin)), v


class FamilyBlock(Block):
    """Pre-norm block with `FamilyAttention` and a dense `GatedMLP` or a `MoEMLP` (per `moe_layers`)."""

    def __init__(self, cfg: MDMConfig, layer: int):
        nn.Module.__init__(self)
        self.layer = layer
        self.ln1 = RMSNorm(cfg)
        self.attn = FamilyAttention(cfg)
        self.ln2 = RMSNorm(cfg)
        moe_layers = cfg.extra.get("moe_layers") or []
        self.is_moe = bool(moe_layers[layer]) if layer < len(moe_layers) else False
        self.mlp = MoEMLP(cfg) if self.is_moe else GatedMLP(cfg)
        for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            setattr(self, name, HookPoint())


def make_block(cfg: MDMConfig, layer: int) -> Block:
    """The block for `layer`: `FamilyBlock` for the families above, the plain `Block` otherwise."""
    if cfg.extra.get("arch") in FAMILY_ARCHES:
        return FamilyBlock(cfg, layer)
    return Block(cfg, layer)
