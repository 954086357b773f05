"""The TransformerLens weight views alone rebuild the forward pass, as TL users write it: per layer an
einsum with W_Q/W_K/W_V (+ b_Q/b_K/b_V), rotate-half RoPE, softmax, W_O (+ b_O), then the gated MLP
with W_gate/W_in/W_out (+ b_in/b_out), RMSNorm weights, W_E and W_U (+ b_U). Under MHA, GQA and MQA,
bidirectional and causal. A head grouping that is wrong under GQA (tiling kv heads instead of
repeat-interleaving them) is shown to break the match, so the test would catch it."""

from __future__ import annotations

import pytest
import torch
from einops import einsum

from mdm_lens import HookedMDM, MDMConfig


def make(n_kv: int, attention: str = "bidirectional", qkv_bias: bool = True, d_head: int | None = None):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, d_mlp=40, d_vocab=50, d_head=d_head,
                    attention=attention, qkv_bias=qkv_bias, rope_theta=500.0, norm_eps=1e-5, mask_token_id=49)
    model = HookedMDM.from_config(cfg, seed=7, init_std=0.3)
    with torch.no_grad():  # non-trivial norm weights, so a skipped or misplaced norm weight is visible
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith(".w"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def rms(x, w, eps):
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w


def rope(x, theta):
    """Rotate-half RoPE on [batch, pos, head, d_head], positions 0..T-1, written from the formula."""
    t, e = x.shape[1], x.shape[-1]
    inv = theta ** (-torch.arange(0, e, 2, dtype=torch.float64) / e)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]  # [pos, e/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., : e // 2].double(), x[..., e // 2:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def forward_from_views(model: HookedMDM, tokens, group=lambda w, layer: w):
    """Logits from the views only. `group(W, layer)` may regroup the per-head K/V views (used to plant a bug)."""
    cfg = model.cfg
    resid = model.W_E[tokens]
    causal = cfg.attention == "causal"
    t = tokens.shape[1]
    for layer in range(cfg.n_layers):
        block = model.blocks[layer]
        x = rms(resid, block.ln1.w, cfg.norm_eps)
        q = einsum(x, model.W_Q[layer], "b p d, h d e -> b p h e") + model.b_Q[layer]
        k = einsum(x, group(model.W_K[layer], layer), "b p d, h d e -> b p h e") + group(model.b_K[layer], layer)
        v = einsum(x, group(model.W_V[layer], layer), "b p d, h d e -> b p h e") + group(model.b_V[layer], layer)
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        scores = einsum(q, k, "b q h e, b k h e -> b h q k") / cfg.d_head ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        z = einsum(scores.softmax(-1), v, "b h q k, b k h e -> b q h e")
        resid = resid + einsum(z, model.W_O[layer], "b p h e, h e d -> b p d") + model.b_O[layer]
        x = rms(resid, block.ln2.w, cfg.norm_eps)
        gate = einsum(x, model.W_gate[layer], "b p d, d m -> b p m")
        up = einsum(x, model.W_in[layer], "b p d, d m -> b p m") + block.mlp.b_in
        resid = resid + einsum(torch.nn.functional.silu(gate) * up, model.W_out[layer], "b p m, m d -> b p d")
        resid = resid + block.mlp.b_out
    return einsum(rms(resid, model.ln_final.w, cfg.norm_eps), model.W_U, "b p d, d v -> b p v") + model.b_U


@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_views_rebuild_the_forward(n_kv, attention, qkv_bias):
    model = make(n_kv, attention, qkv_bias)
    tokens = torch.randint(0, 49, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = forward_from_views(model, tokens)
        want = model(tokens)
    assert (got - want).abs().max().item() <= 1e-4


def test_views_rebuild_the_forward_with_a_head_dim_of_its_own():
    model = make(2, d_head=12)  # d_head * n_heads != d_model
    assert model.W_Q.shape == (2, 4, 32, 12) and model.W_O.shape == (2, 4, 12, 32)
    tokens = torch.randint(0, 49, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (forward_from_views(model, tokens) - model(tokens)).abs().max().item() <= 1e-4


def tiled(w, layer, n_heads=4, n_kv=2):
    """The classic GQA slip: query head h served by kv head h % n_kv instead of h // (n_heads / n_kv)."""
    kv = w[:: n_heads // n_kv]  # one copy of each kv head
    return kv.repeat(n_heads // n_kv, *([1] * (w.ndim - 1)))


def test_a_wrong_gqa_head_grouping_fails_the_rebuild():
    model = make(2)
    tokens = torch.randint(0, 49, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wrong = forward_from_views(model, tokens, group=tiled)
        right = model(tokens)
    assert (wrong - right).abs().max().item() > 1e-2


def test_gqa_views_repeat_each_kv_head_for_consecutive_query_heads():
    """W_K[h] == kv head h // r, checked against the fused parameter itself (HF repeat_kv order)."""
    model = make(2)
    attn = model.blocks[1].attn
    q_rows, kv_rows = 4 * 8, 2 * 8
    k_weight = attn.qkv_weight[q_rows:q_rows + kv_rows]  # [(g e), d]
    v_bias = attn.qkv_bias[q_rows + kv_rows:]
    for h in range(4):
        g = h // 2
        torch.testing.assert_close(model.W_K[1, h], k_weight[g * 8:(g + 1) * 8].T)
        torch.testing.assert_close(model.b_V[1, h], v_bias[g * 8:(g + 1) * 8])


def test_views_that_are_views_write_through():
    """W_Q, W_O, W_in, W_gate, W_out, W_E, W_U view the fused parameters (TL: editing them edits the model)."""
    model = make(2)
    tokens = torch.randint(0, 49, (1, 6), generator=torch.Generator().manual_seed(4))
    base = model(tokens).detach()
    for get in (lambda m: m.blocks[0].attn.W_Q, lambda m: m.blocks[0].attn.W_O, lambda m: m.blocks[1].mlp.W_in,
                lambda m: m.blocks[1].mlp.W_gate, lambda m: m.blocks[0].mlp.W_out, lambda m: m.W_E,
                lambda m: m.W_U, lambda m: m.blocks[0].attn.b_Q):
        m = make(2)
        with torch.no_grad():
            get(m).mul_(0.0)
            assert get(m).abs().sum() == 0
            assert (m(tokens) - base).abs().max() > 1e-3
