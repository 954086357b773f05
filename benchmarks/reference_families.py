"""Independent plain-torch forwards of LLaDA2.x (`LLaDA2MoeModelLM`) and LLaDA-MoE (`LLaDAMoEModelLM`) on a hub
state dict, written for `bench_families` from the reference modeling code (ZHZisZZ/dllm @ ca176752,
`dllm/pipelines/llada2/models/modeling_llada2_moe.py`, `dllm/pipelines/llada/models/modeling_lladamoe.py`), in the
form the reference runs at inference (SDPA attention, its expert dispatch: LLaDA2's sort-by-expert `moe_infer`,
LLaDA-MoE's one-hot loop with `index_add_`). Nothing from mdm_lens is used, so the benchmark compares two
implementations of the same computation; the bench checks their logits agree before timing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(n: int, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    half = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1)
    return torch.cat((xr * cos + half * sin, xp), -1)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # transformers' repeat_kv before SDPA
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _mlp(sd: dict, p: str, x: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x, sd[p + "gate_proj.weight"])) * F.linear(x, sd[p + "up_proj.weight"]),
                    sd[p + "down_proj.weight"])


def _llada2_moe(sd: dict, c: dict, p: str, x: Tensor) -> Tensor:
    """Sigmoid router in fp32, bias for selection only, group-limited top-k, renormalised and scaled weights,
    the sort-by-expert dispatch of the reference's `moe_infer`, plus the shared experts."""
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    logits = F.linear(flat.float(), sd[p + "gate.weight"].float())
    scores = torch.sigmoid(logits)
    routing = scores + sd[p + "gate.expert_bias"]
    n, groups, k = c["num_experts"], c["n_group"], c["num_experts_per_tok"]
    group_scores = routing.view(-1, groups, n // groups).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(c["topk_group"], dim=-1, sorted=False)[1], 1)
    keep = keep[..., None].expand(-1, groups, n // groups).reshape(-1, n).bool()
    idx = routing.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    if k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * c["routed_scaling_factor"]
    counts = torch.zeros(flat.shape[0], n, dtype=torch.long).scatter_(1, idx, 1).sum(0).tolist()
    order = idx.view(-1).argsort()
    tokens = flat[order // k]
    outs, start = [], 0
    for e, cnt in enumerate(counts):
        if cnt:
            outs.append(_mlp(sd, f"{p}experts.{e}.", tokens[start:start + cnt]))
            start += cnt
    merged = torch.empty_like(tokens)
    merged[order] = torch.cat(outs)
    y = (merged.view(-1, k, d).float() * w[..., None]).sum(1).to(x.dtype).view(b, t, d)
    return y + _mlp(sd, p + "shared_experts.", x)


@torch.no_grad()
def llada2_forward(sd: dict, c: dict, tokens: Tensor, mask: Tensor | None) -> Tensor:
    """Logits `[batch, pos, vocab]` of LLaDA2MoeModelLM; `mask` is the additive 4-D block mask (or None)."""
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd, eps = c["head_dim"], c["rms_norm_eps"]
    b, t = tokens.shape
    cos, sin = _rope(t, int(hd * c["partial_rotary_factor"]), c["rope_theta"])
    x = F.embedding(tokens, sd["model.word_embeddings.weight"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = F.linear(a, sd[p + "attention.query_key_value.weight"], sd.get(p + "attention.query_key_value.bias"))
        q, k, v = qkv.view(b, t, h + 2 * kv, hd).split([h, kv, kv], dim=-2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if c["use_qk_norm"]:
            q = _rms(q, sd[p + "attention.query_layernorm.weight"], eps)
            k = _rms(k, sd[p + "attention.key_layernorm.weight"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + F.linear(_attend(q, k, v, mask), sd[p + "attention.dense.weight"], sd.get(p + "attention.dense.bias"))
        m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + (_mlp(sd, p + "mlp.", m) if i < c["first_k_dense_replace"] else _llada2_moe(sd, c, p + "mlp.", m))
    return F.linear(_rms(x, sd["model.norm.weight"], eps), sd["lm_head.weight"])


def _lladamoe_moe(sd: dict, c: dict, p: str, x: Tensor) -> Tensor:
    """Softmax router; with an expert bias the reference adds it to the routing weights themselves; top-k weights
    not renormalised; the one-hot expert loop with `index_add_`."""
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    weights = F.softmax(F.linear(flat, sd[p + "mlp.gate.weight"]), dim=1, dtype=torch.float)
    if p + "mlp.expert_bias" in sd:
        weights = weights + sd[p + "mlp.expert_bias"]
    weights, chosen = torch.topk(weights, c["num_experts_per_tok"], dim=-1)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(flat)
    expert_mask = F.one_hot(chosen, num_classes=c["num_experts"]).permute(2, 1, 0)
    for e in range(c["num_experts"]):
        slot, rows = torch.where(expert_mask[e])
        y = _mlp(sd, f"{p}mlp.experts.{e}.", flat[rows]) * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    out = out.view(b, t, d)
    if p + "shared_expert.gate_proj.weight" in sd:
        out = out + _mlp(sd, p + "shared_expert.", x)
    return out


@torch.no_grad()
def lladamoe_forward(sd: dict, c: dict, tokens: Tensor) -> Tensor:
    """Logits of LLaDAMoEModelLM (bidirectional: the reference passes no mask)."""
    h = c["num_attention_heads"]
    kv = c["num_key_value_heads"] or h
    d, eps = c["hidden_size"], c["rms_norm_eps"]
    hd = d // h
    b, t = tokens.shape
    cos, sin = _rope(t, int(hd * c["partial_rotary_factor"]), c["rope_theta"])
    x = F.embedding(tokens, sd["model.embed_tokens.weight"])
    clip = c["clip_qkv"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = F.linear(a, sd[p + "self_attn.q_proj.weight"], sd.get(p + "self_attn.q_proj.bias"))
        k = F.linear(a, sd[p + "self_attn.k_proj.weight"], sd.get(p + "self_attn.k_proj.bias"))
        if c["qk_layernorm"]:  # per head, before the heads are split off
            q = _rms(q.reshape(-1, hd), sd[p + "self_attn.q_norm.weight"], eps).reshape(b, t, -1)
            k = _rms(k.reshape(-1, hd), sd[p + "self_attn.k_norm.weight"], eps).reshape(b, t, -1)
        v = F.linear(a, sd[p + "self_attn.v_proj.weight"], sd.get(p + "self_attn.v_proj.bias"))
        if clip is not None:
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q = q.view(b, t, h, hd).transpose(1, 2)
        k = k.view(b, t, kv, hd).transpose(1, 2)
        v = v.view(b, t, kv, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + F.linear(_attend(q, k, v, None), sd[p + "self_attn.o_proj.weight"], sd.get(p + "self_attn.o_proj.bias"))
        m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + (_lladamoe_moe(sd, c, p, m) if c["moe_layer_freq"][i] else _mlp(sd, p + "mlp.", m))
    return F.linear(_rms(x, sd["model.norm.weight"], eps), sd["lm_head.weight"])
