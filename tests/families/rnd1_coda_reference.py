"""Plain-torch transcriptions of the RND1 (`RND1LM`, hf MoE backend) and CoDA (`CoDALanguageModel`, eval mode)
forwards, written from RadicalNumerics/RND1 @ 87d5f465 and SalesforceAIResearch/CoDA @ fa1d5050 on the hub state
dict; nothing shared with mdm_lens. Experts run one expert at a time over the rows that picked it, as the
reference does; the routing weights stay fp32 (RND1) until their product with the expert output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from family_reference import attend, rms, rope, swiglu


def _attention(x, sd, p, c, bias: bool):
    b, t, _ = x.shape
    e, eps = c["head_dim"], c["rms_norm_eps"]

    def proj(name):
        w = sd[f"{p}self_attn.{name}_proj.weight"]
        return F.linear(x, w, sd.get(f"{p}self_attn.{name}_proj.bias") if bias else None).view(b, t, -1, e)

    q = rms(proj("q"), sd[p + "self_attn.q_norm.weight"], eps).transpose(1, 2)
    k = rms(proj("k"), sd[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
    v = proj("v").transpose(1, 2)
    q, k = rope(q, e, float(c["rope_theta"])), rope(k, e, float(c["rope_theta"]))
    out = attend(q, k, v, None)  # RND1: no mask is ever built; CoDA: the attention ignores any mask
    return F.linear(out, sd[p + "self_attn.o_proj.weight"], sd.get(p + "self_attn.o_proj.bias") if bias else None)


def rnd1_moe(x, sd, p, c):
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    router = F.linear(flat, sd[p + "mlp.gate.weight"])
    w = F.softmax(router, dim=1, dtype=torch.float32)
    w, chosen = torch.topk(w, c["num_experts_per_tok"], dim=-1)
    if c["norm_topk_prob"]:
        w = w / w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(flat)
    for expert in range(c["num_experts"]):
        rows, slot = torch.where(chosen == expert)
        if rows.numel():
            y = swiglu(flat[rows], sd, f"{p}mlp.experts.{expert}.")
            out.index_add_(0, rows, (y * w[rows, slot, None]).to(flat.dtype))
    return out.view(b, t, d)


def _forward(sd, c, tokens, mlp, bias):
    eps = c["rms_norm_eps"]
    h = F.embedding(tokens, sd["model.embed_tokens.weight"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = h + _attention(rms(h, sd[p + "input_layernorm.weight"], eps), sd, p, c, bias)
        h = h + mlp(rms(h, sd[p + "post_attention_layernorm.weight"], eps), sd, p, c)
    return F.linear(rms(h, sd["model.norm.weight"], eps), sd["lm_head.weight"])


def rnd1_forward(sd: dict, c: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Raw (unshifted) logits of `RND1LM` [batch, pos, vocab]."""
    return _forward(sd, c, tokens, rnd1_moe, bias=False)


def coda_forward(sd: dict, c: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Raw (unshifted) logits of `CoDALanguageModel` in eval mode (the first element of its tuple)."""
    return _forward(sd, c, tokens, lambda x, sd_, p, c_: swiglu(x, sd_, p + "mlp."), bias=bool(c["attention_bias"]))
