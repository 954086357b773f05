"""A plain-torch transcription of the DDiT reference forward (kuleshov-group/mdlm `models/dit.py` @ c112c526,
the hub `modeling_mdlm.py` / Duo `model.py` that share it; families-2.md §1.2) operating directly on a hub state dict.
Written independently of mdm_lens.ddit: packed qkv in the reference's 5-D layout, the [1, L, 3, 1, hd] cos/sin
tables with the v slot forced to identity, flash-attn's varlen call replaced by per-row full attention (what it
computes with uniform cu_seqlens), and the hub's SUBS / log-softmax post-processing."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), [x.shape[-1]]) * w[None, None, :]


def _rotary(seq_len: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(seq_len).type_as(inv_freq)
    freqs = torch.einsum("i,j->ij", t, inv_freq.clone())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    cos[:, :, 2, :, :].fill_(1.0)
    sin[:, :, 2, :, :].fill_(0.0)
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def reference_forward(sd: dict, n_heads: int, x: torch.Tensor, sigma: torch.Tensor,
                      time_conditioning: bool = True) -> torch.Tensor:
    """Logits [B, L, V] of the DDiT backbone (hub `DITBackbone.forward` in eval mode, fp32)."""
    p = "backbone."
    if not time_conditioning:
        sigma = torch.zeros_like(sigma)
    h = sd[p + "vocab_embed.embedding"][x]
    f = _timestep_embedding(sigma)
    emb = F.linear(F.silu(F.linear(f, sd[p + "sigma_map.mlp.0.weight"], sd[p + "sigma_map.mlp.0.bias"])),
                   sd[p + "sigma_map.mlp.2.weight"], sd[p + "sigma_map.mlp.2.bias"])
    c = F.silu(emb)
    B, L = x.shape
    cos, sin = _rotary(L, sd[p + "rotary_emb.inv_freq"])
    n_blocks = len({k.split(".")[2] for k in sd if k.startswith(p + "blocks.")})
    for i in range(n_blocks):
        b = f"{p}blocks.{i}."
        mods = F.linear(c, sd[b + "adaLN_modulation.weight"], sd[b + "adaLN_modulation.bias"])[:, None].chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        skip = h
        u = _layer_norm(h, sd[b + "norm1.weight"]) * (1 + scale_msa) + shift_msa
        qkv = F.linear(u, sd[b + "attn_qkv.weight"]).view(B, L, 3, n_heads, -1)  # 'b s (three h d)'
        qkv = qkv * cos.to(qkv.dtype) + _rotate_half(qkv) * sin.to(qkv.dtype)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
        att = att.transpose(1, 2).reshape(B, L, -1)
        h = skip + gate_msa * F.linear(att, sd[b + "attn_out.weight"])
        u = _layer_norm(h, sd[b + "norm2.weight"]) * (1 + scale_mlp) + shift_mlp
        y = F.linear(F.gelu(F.linear(u, sd[b + "mlp.0.weight"], sd[b + "mlp.0.bias"]), approximate="tanh"),
                     sd[b + "mlp.2.weight"], sd[b + "mlp.2.bias"])
        h = h + gate_mlp * y
    o = p + "output_layer."
    shift, scale = F.linear(c, sd[o + "adaLN_modulation.weight"], sd[o + "adaLN_modulation.bias"])[:, None].chunk(2, 2)
    z = _layer_norm(h, sd[o + "norm_final.weight"]) * (1 + scale) + shift
    return F.linear(z, sd[o + "linear.weight"], sd[o + "linear.bias"])


def reference_subs(logits: torch.Tensor, xt: torch.Tensor, mask_index: int) -> torch.Tensor:
    """`Diffusion._subs_parameterization` (neg_infinity = -1e6, in place on a copy)."""
    logits = logits.clone()
    logits[:, :, mask_index] += -1000000.0
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked_indices = xt != mask_index
    logits[unmasked_indices] = -1000000.0
    logits[unmasked_indices, xt[unmasked_indices]] = 0
    return logits
