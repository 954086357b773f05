"""Compact, independent transcriptions of the LLaDA2 and LLaDA-MoE reference forwards (plain torch on the hub
state dict; nothing shared with mdm_lens). Experts run token by token, slot by slot, to stay far from the
library's batched dispatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """x [batch, head, pos, e]; rotate-half on the first `dim` dims, the rest unchanged."""
    pos = torch.arange(x.shape[2], dtype=torch.float32)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def attend(q, k, v, mask) -> torch.Tensor:
    """q [b, h, t, e], k/v [b, g, t, e]; eager attention with an additive mask (or None)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = (q @ k.transpose(2, 3)) * q.shape[-1] ** -0.5
    if mask is not None:
        w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return (w @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def swiglu(x, sd, p):
    return F.linear(F.silu(F.linear(x, sd[p + "gate_proj.weight"])) * F.linear(x, sd[p + "up_proj.weight"]),
                    sd[p + "down_proj.weight"])


def group_topk(scores: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    t, n = scores.shape
    group = scores.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group, k=topk_group, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(group)
    gmask.scatter_(1, chosen, 1)
    smask = gmask.unsqueeze(-1).expand(t, n_group, n // n_group).reshape(t, -1)
    return torch.topk(scores.masked_fill(~smask.bool(), float("-inf")), k=k, dim=-1)[1]


def llada2_moe(x, sd, p, c):
    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat.float(), sd[p + "gate.weight"].float())
    scores = torch.sigmoid(logits)
    idx = group_topk(scores + sd[p + "gate.expert_bias"], c["num_experts_per_tok"], c["n_group"], c["topk_group"])
    w = scores.gather(1, idx)
    if c["num_experts_per_tok"] > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * c["routed_scaling_factor"]
    out = torch.zeros_like(flat, dtype=torch.float32)
    for t in range(flat.shape[0]):
        for j in range(idx.shape[1]):
            out[t] += w[t, j] * swiglu(flat[t], sd, f"{p}experts.{int(idx[t, j])}.").float()
    y = out.to(x.dtype).view_as(x)
    if c["num_shared_experts"]:
        y = y + swiglu(x, sd, p + "shared_experts.")
    return y


def llada2_forward(sd: dict, c: dict, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    h, g, e, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    x = F.embedding(tokens, sd["model.word_embeddings.weight"])
    b, t, _ = x.shape
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = F.linear(a, sd[p + "attention.query_key_value.weight"], sd.get(p + "attention.query_key_value.bias"))
        q, k, v = qkv.view(b, t, h + 2 * g, e).split([h, g, g], dim=-2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if c["use_qk_norm"]:
            q = rms(q, sd[p + "attention.query_layernorm.weight"], eps)
            k = rms(k, sd[p + "attention.key_layernorm.weight"], eps)
        dim = int(e * c["partial_rotary_factor"])
        q, k = rope(q, dim, c["rope_theta"]), rope(k, dim, c["rope_theta"])
        x = x + F.linear(attend(q, k, v, mask), sd[p + "attention.dense.weight"], sd.get(p + "attention.dense.bias"))
        m = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i >= c["first_k_dense_replace"]:
            x = x + llada2_moe(m, sd, p + "mlp.", c)
        else:
            x = x + swiglu(m, sd, p + "mlp.")
    x = rms(x, sd["model.norm.weight"], eps)
    return F.linear(x, sd["lm_head.weight"]).float()


def lladamoe_moe(x, sd, p, c):
    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(F.linear(flat, sd[p + "gate.weight"]), dim=1, dtype=torch.float)
    if c["moe_router_enable_expert_bias"]:
        probs = probs + sd[p + "expert_bias"]
    w, idx = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
    w = w.to(x.dtype)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(idx.shape[1]):
            out[t] += swiglu(flat[t], sd, f"{p}experts.{int(idx[t, j])}.") * w[t, j]
    return out.view_as(x)


def lladamoe_forward(sd: dict, c: dict, tokens: torch.Tensor) -> torch.Tensor:
    h, eps = c["num_attention_heads"], c["rms_norm_eps"]
    g = c["num_key_value_heads"] or h
    e = c["hidden_size"] // h
    x = F.embedding(tokens, sd["model.embed_tokens.weight"])
    b, t, _ = x.shape
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"], eps)
        q = F.linear(a, sd[p + "self_attn.q_proj.weight"], sd.get(p + "self_attn.q_proj.bias"))
        k = F.linear(a, sd[p + "self_attn.k_proj.weight"], sd.get(p + "self_attn.k_proj.bias"))
        if c["qk_layernorm"]:
            q = rms(q.reshape(-1, e), sd[p + "self_attn.q_norm.weight"], eps).reshape(b, t, -1)
            k = rms(k.reshape(-1, e), sd[p + "self_attn.k_norm.weight"], eps).reshape(b, t, -1)
        v = F.linear(a, sd[p + "self_attn.v_proj.weight"], sd.get(p + "self_attn.v_proj.bias"))
        if c["clip_qkv"] is not None:
            q, k, v = (z.clamp(-c["clip_qkv"], c["clip_qkv"]) for z in (q, k, v))
        q = q.view(b, t, h, e).transpose(1, 2)
        k = k.view(b, t, g, e).transpose(1, 2)
        v = v.view(b, t, g, e).transpose(1, 2)
        dim = int(e * c["partial_rotary_factor"])
        q, k = rope(q, dim, c["rope_theta"]), rope(k, dim, c["rope_theta"])
        x = x + F.linear(attend(q, k, v, None), sd[p + "self_attn.o_proj.weight"], sd.get(p + "self_attn.o_proj.bias"))
        m = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if c["moe_layer_freq"][i]:
            y = lladamoe_moe(m, sd, p + "mlp.", c)
            if c["shared_expert_intermediate_size"] is not None:
                y = y + swiglu(m, sd, p + "shared_expert.")
        else:
            y = swiglu(m, sd, p + "mlp.")
        x = x + y
    x = rms(x, sd["model.norm.weight"], eps)
    return F.linear(x, sd["lm_head.weight"]).float()
