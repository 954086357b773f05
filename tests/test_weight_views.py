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


# --- issue #32: views that are copies refuse writes; views that are views write through -----------------------
from mdm_lens.errors import ArgumentError, ReadOnlyViewError  # noqa: E402


def realistic(n_kv: int = 2, qkv_bias: bool = True):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, d_mlp=40, d_vocab=50, qkv_bias=qkv_bias,
                    rope_theta=500.0, mask_token_id=49)
    return HookedMDM.from_config(cfg, seed=7, init_std=0.3, init="realistic")


WRITE_THROUGH = {  # view -> the parameter slice it must equal after the write
    "blocks[0].attn.W_Q": (lambda m: m.blocks[0].attn.W_Q[1], lambda m: m.blocks[0].attn.qkv_weight[8:16].T),
    "blocks[0].attn.W_O": (lambda m: m.blocks[0].attn.W_O[2], lambda m: m.blocks[0].attn.o_weight[:, 16:24].T),
    "blocks[0].attn._W_K": (lambda m: m.blocks[0].attn._W_K[1], lambda m: m.blocks[0].attn.qkv_weight[40:48].T),
    "blocks[0].attn._W_V": (lambda m: m.blocks[0].attn._W_V[0], lambda m: m.blocks[0].attn.qkv_weight[48:56].T),
    "blocks[1].attn.b_Q": (lambda m: m.blocks[1].attn.b_Q[3], lambda m: m.blocks[1].attn.qkv_bias[24:32]),
    "blocks[1].mlp.W_in": (lambda m: m.blocks[1].mlp.W_in, lambda m: m.blocks[1].mlp.gate_up_weight[40:].T),
    "blocks[1].mlp.W_gate": (lambda m: m.blocks[1].mlp.W_gate, lambda m: m.blocks[1].mlp.gate_up_weight[:40].T),
    "blocks[0].mlp.W_out": (lambda m: m.blocks[0].mlp.W_out, lambda m: m.blocks[0].mlp.down_weight.T),
    "W_E": (lambda m: m.W_E[3], lambda m: m.embed.W_E[3]),
    "W_U": (lambda m: m.W_U[:, 5], lambda m: m.unembed.weight[5]),
}


@pytest.mark.parametrize("name", list(WRITE_THROUGH))
def test_write_through_edits_the_parameter_and_the_forward(name):
    view, param = WRITE_THROUGH[name]
    m, ref = realistic(), realistic()
    tokens = torch.tensor([[3, 5, 10, 20, 30, 40]])  # holds the edited embedding row 3
    with torch.no_grad():
        view(m).add_(0.5)
        param(ref).add_(0.5)  # the same edit made on the parameter itself
        torch.testing.assert_close(param(m), param(ref))
        torch.testing.assert_close(m(tokens), ref(tokens))
        assert (m(tokens) - realistic()(tokens)).abs().max() > 1e-3


def test_mha_key_value_views_write_through():
    m, ref = realistic(n_kv=4), realistic(n_kv=4)
    with torch.no_grad():
        m.blocks[0].attn.W_K[2] += 1.0
        m.blocks[0].attn.b_V[1] += 1.0
        ref.blocks[0].attn.qkv_weight[32 + 16:32 + 24] += 1.0
        ref.blocks[0].attn.qkv_bias[64 + 8:64 + 16] += 1.0
    torch.testing.assert_close(m.blocks[0].attn.qkv_weight, ref.blocks[0].attn.qkv_weight)
    torch.testing.assert_close(m.blocks[0].attn.qkv_bias, ref.blocks[0].attn.qkv_bias)


READ_ONLY = {
    "stacked W_Q": lambda m: m.W_Q, "stacked W_K": lambda m: m.W_K, "stacked W_V": lambda m: m.W_V,
    "stacked W_O": lambda m: m.W_O, "stacked W_in": lambda m: m.W_in, "stacked W_gate": lambda m: m.W_gate,
    "stacked W_out": lambda m: m.W_out, "stacked b_Q": lambda m: m.b_Q, "stacked b_K": lambda m: m.b_K,
    "stacked b_V": lambda m: m.b_V, "stacked b_O": lambda m: m.b_O,
    "GQA W_K": lambda m: m.blocks[0].attn.W_K, "GQA W_V": lambda m: m.blocks[0].attn.W_V,
    "GQA b_K": lambda m: m.blocks[0].attn.b_K, "GQA b_V": lambda m: m.blocks[0].attn.b_V,
    "zero b_O": lambda m: m.blocks[0].attn.b_O, "zero b_in": lambda m: m.blocks[0].mlp.b_in,
    "zero b_out": lambda m: m.blocks[0].mlp.b_out, "zero b_U": lambda m: m.b_U,
}


@pytest.mark.parametrize("name", list(READ_ONLY))
@pytest.mark.parametrize("write", ["index_iadd", "setitem", "method", "out"])
def test_copies_refuse_writes_and_leave_the_model_unchanged(name, write):
    m = realistic()
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    t = READ_ONLY[name](m)
    with torch.no_grad(), pytest.raises(ReadOnlyViewError, match="edit|not a parameter|no "):
        if write == "index_iadd":
            t[0] += 1.0
        elif write == "setitem":
            t[0] = 1.0
        elif write == "method":
            t.mul_(0.0)
        else:
            torch.add(t, 1.0, out=t)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_zero_q_bias_view_refuses_writes_without_a_bias():
    m = realistic(qkv_bias=False)
    with pytest.raises(ReadOnlyViewError, match="no q/k/v bias"):
        m.blocks[0].attn.b_Q.add_(1.0)


def test_read_only_views_read_like_tensors():
    """Arithmetic and indexing still work; results that do not alias the view are ordinary (writable) tensors."""
    m = realistic()
    W = m.W_Q
    torch.testing.assert_close(W[1], m.blocks[1].attn.W_Q)
    x = W.sum(0)
    x += 1.0  # a fresh tensor: no error
    assert type(x) is torch.Tensor
    assert isinstance(W[1, 2], type(W))  # an alias stays read-only


def test_processed_output_bias_is_a_parameter_that_writes_through():
    m = realistic().process_weights_(fold_ln=False, center_unembed=False, fold_value_biases=True)
    ref = realistic().process_weights_(fold_ln=False, center_unembed=False, fold_value_biases=True)
    tokens = torch.randint(0, 49, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        m.blocks[0].attn.b_O[3] += 1.0
    assert (m(tokens) - ref(tokens)).abs().max() > 1e-3
    assert m.blocks[0].attn.o_bias[3] == ref.blocks[0].attn.o_bias[3] + 1.0


# --- circuit views -------------------------------------------------------------------------------------------
def test_ov_and_qk_are_factored_per_query_head():
    m = realistic(n_kv=2)
    ov, qk = m.OV, m.QK
    assert ov.shape == (2, 4, 32, 32) and qk.shape == (2, 4, 32, 32)
    attn = m.blocks[1].attn
    torch.testing.assert_close(ov.AB[1, 3], attn._W_V[1] @ attn.W_O[3])  # query head 3 reads kv head 3 // 2
    torch.testing.assert_close(qk.AB[1, 2], attn.W_Q[2] @ attn._W_K[1].T)
    torch.testing.assert_close(qk.AB[1, 1], attn.W_Q[1] @ attn._W_K[0].T)


def test_qk_is_the_zero_offset_score_form():
    """x_i QK x_jᵀ / √d_head equals the pre-softmax score of query i on key j when i = j (rotary is the identity
    at offset 0 only), on a one-token input; QK leaves out the norm weight while it is not folded."""
    m = realistic(n_kv=2, qkv_bias=False)
    _, cache = m.run_with_cache(torch.tensor([[7]]), names_filter=lambda n: n in (
        "blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_attn_scores"))
    n = cache["blocks.0.ln1.hook_normalized"][0, 0] * m.blocks[0].ln1.w
    want = cache["blocks.0.attn.hook_attn_scores"][0, :, 0, 0]
    got = torch.einsum("d,hde,e->h", n, m.QK.AB[0], n) / m.cfg.d_head ** 0.5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_composition_scores_match_tl_definition():
    m = realistic(n_kv=2).process_weights_(center_unembed=False)
    for mode in ("Q", "K", "V"):
        s = m.all_composition_scores(mode)
        assert s.shape == (2, 4, 2, 4)
        assert torch.isnan(s[1, :, 0]).all() and torch.isnan(s[0, :, 0]).all()  # no composition backwards
        left = (m.W_V[0, 2] @ m.W_O[0, 2])
        right = {"Q": m.W_Q[1, 1] @ m.W_K[1, 1].T, "K": (m.W_Q[1, 1] @ m.W_K[1, 1].T).T,
                 "V": m.W_V[1, 1] @ m.W_O[1, 1]}[mode]
        want = (left @ right).norm() / left.norm() / right.norm()
        torch.testing.assert_close(s[0, 2, 1, 1], want, atol=1e-5, rtol=1e-4)
        assert 0 < float(s[0, 2, 1, 1]) < 1
    with pytest.raises(ArgumentError, match="mode"):
        m.all_composition_scores("X")
