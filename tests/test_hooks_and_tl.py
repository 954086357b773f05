"""TransformerLens hook points, shapes, fast/explicit path agreement and TL helper compatibility."""

from __future__ import annotations

import pytest
import torch
from transformer_lens import ActivationCache, patching

from mdm_lens import HookedMDM, HookNameError, MDMConfig


def tiny(attention="bidirectional", n_kv=2, qkv_bias=True, **kw):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, d_mlp=48, d_vocab=50, attention=attention,
                    qkv_bias=qkv_bias, mask_token_id=49, **kw)
    return HookedMDM.from_config(cfg, seed=1, init_std=0.2)


def test_cache_holds_tl_names_and_shapes():
    model = tiny()
    tokens = torch.randint(0, 49, (2, 7))
    logits, cache = model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    assert logits.shape == (2, 7, 50)
    b, p, h, g, e, d = 2, 7, 4, 2, 8, 32
    expected = {
        "hook_embed": (b, p, d), "blocks.0.hook_resid_pre": (b, p, d), "blocks.0.ln1.hook_scale": (b, p, 1),
        "blocks.0.ln1.hook_normalized": (b, p, d), "blocks.0.attn.hook_q": (b, p, h, e),
        "blocks.0.attn.hook_k": (b, p, g, e), "blocks.0.attn.hook_v": (b, p, g, e),
        "blocks.0.attn.hook_rot_q": (b, p, h, e), "blocks.0.attn.hook_rot_k": (b, p, g, e),
        "blocks.0.attn.hook_attn_scores": (b, h, p, p), "blocks.0.attn.hook_pattern": (b, h, p, p),
        "blocks.0.attn.hook_z": (b, p, h, e), "blocks.0.hook_attn_out": (b, p, d), "blocks.0.hook_resid_mid": (b, p, d),
        "blocks.0.ln2.hook_scale": (b, p, 1), "blocks.0.mlp.hook_pre": (b, p, 48), "blocks.0.mlp.hook_post": (b, p, 48),
        "blocks.0.hook_mlp_out": (b, p, d), "blocks.1.hook_resid_post": (b, p, d), "ln_final.hook_scale": (b, p, 1),
        "ln_final.hook_normalized": (b, p, d),
    }
    for name, shape in expected.items():
        assert tuple(cache[name].shape) == shape, name
    pattern = cache["pattern", 0]  # TL shorthand works
    torch.testing.assert_close(pattern.sum(-1), torch.ones(b, h, p))
    assert "blocks.0.attn.hook_result" not in cache  # opt-in


def test_hook_result_opt_in_sums_to_attn_out():
    model = tiny(use_attn_result=True)
    _, cache = model.run_with_cache(torch.randint(0, 49, (1, 6)))
    res = cache["blocks.1.attn.hook_result"]
    assert res.shape == (1, 6, 4, 32)
    torch.testing.assert_close(res.sum(2), cache["blocks.1.hook_attn_out"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
@pytest.mark.parametrize("n_kv", [4, 2, 1])  # MHA, GQA, MQA: the explicit path groups query heads per kv head
@pytest.mark.parametrize("padding", [None, "key", "pair"])
def test_sdpa_and_explicit_paths_agree(attention, n_kv, padding):
    model = tiny(attention, n_kv=n_kv, padding_mask=padding or "key")
    tokens = torch.randint(0, 49, (3, 9))
    am = torch.ones_like(tokens)
    if padding:
        am[1, :4] = 0
    with torch.no_grad():
        fast = model(tokens, attention_mask=am)
        for block in model.blocks:
            block.attn.force_explicit = True
        slow = model(tokens, attention_mask=am)
    valid = am.bool()
    assert not slow[valid].isnan().any()
    assert (fast - slow)[valid].abs().max() <= 1e-5


def test_grouped_explicit_pattern_equals_per_head_recomputation():
    """Head j of the pattern uses kv head j // r (HF's repeat_kv order), recomputed here by hand."""
    model = tiny(n_kv=2)
    tokens = torch.randint(0, 49, (2, 7))
    _, cache = model.run_with_cache(tokens)
    q, k = cache["blocks.1.attn.hook_rot_q"], cache["blocks.1.attn.hook_rot_k"]  # [b, p, h|g, e]
    k_rep = k.repeat_interleave(2, dim=2)
    ref = torch.einsum("bqhe,bkhe->bhqk", q, k_rep).div(q.shape[-1] ** 0.5).softmax(-1)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"], ref, atol=1e-6, rtol=1e-5)


def test_explicit_path_only_when_pattern_is_hooked(monkeypatch):
    model = tiny()
    calls = []
    orig = type(model.blocks[0].attn)._explicit
    monkeypatch.setattr(type(model.blocks[0].attn), "_explicit", lambda self, *a: calls.append(1) or orig(self, *a))
    tokens = torch.randint(0, 49, (1, 5))
    model(tokens)
    assert calls == []
    model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_pattern")
    assert calls == [1]  # only the hooked layer paid for the explicit path


def test_causal_pattern_is_lower_triangular_and_bidirectional_is_not():
    for attention, tri in (("causal", True), ("bidirectional", False)):
        _, cache = tiny(attention).run_with_cache(torch.randint(0, 49, (1, 6)))
        upper = cache["pattern", 0][0].triu(1).abs().sum().item()
        assert (upper == 0) == tri


def test_run_with_hooks_can_ablate_and_hooks_are_removed_on_error():
    model = tiny()
    tokens = torch.randint(0, 49, (1, 6))
    base = model(tokens)

    def zero(z, hook):
        return torch.zeros_like(z)

    ablated = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero)])
    assert not torch.allclose(base, ablated)

    def boom(x, hook):
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", boom)])
    assert all(not hp.has_hooks() for hp in model.hook_points())
    torch.testing.assert_close(model(tokens), base)


def test_unknown_hook_name_is_a_typed_error_with_suggestion():
    model = tiny()
    with pytest.raises(HookNameError, match="blocks.0.attn.hook_pattern"):
        model.run_with_hooks(torch.zeros(1, 3, dtype=torch.long), fwd_hooks=[("blocks.0.attn.hook_patern", print)])
    with pytest.raises(HookNameError):
        model.run_with_cache(torch.zeros(1, 3, dtype=torch.long), names_filter=["blocks.9.hook_resid_pre"])
    with pytest.raises(HookNameError):
        model.add_hook("nope", print)


def test_weight_views_are_tl_shaped_and_write_through():
    model = tiny()
    a = model.blocks[0].attn
    assert a.W_Q.shape == (4, 32, 8) and a.W_K.shape == (4, 32, 8) and a._W_K.shape == (2, 32, 8)
    assert a.W_O.shape == (4, 8, 32) and a.b_Q.shape == (4, 8) and a.b_K.shape == (4, 8)
    assert model.W_Q.shape == (2, 4, 32, 8) and model.W_U.shape == (32, 50) and model.W_E.shape == (50, 32)
    m = model.blocks[0].mlp
    assert m.W_in.shape == (32, 48) and m.W_gate.shape == (32, 48) and m.W_out.shape == (48, 32)
    # GQA: TL's repeated W_K serves query head h with kv head h // (n_heads / n_kv_heads)
    torch.testing.assert_close(a.W_K[1], a._W_K[0])
    torch.testing.assert_close(a.W_K[2], a._W_K[1])
    # hook_q equals x @ W_Q + b_Q on the normalised residual
    tokens = torch.randint(0, 49, (1, 5))
    _, cache = model.run_with_cache(tokens)
    x = cache["blocks.0.ln1.hook_normalized"] * model.blocks[0].ln1.w
    q = torch.einsum("bpd,hde->bphe", x, a.W_Q) + a.b_Q
    torch.testing.assert_close(q, cache["blocks.0.attn.hook_q"], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        a.W_Q.zero_()  # a view: editing it edits the model
    assert a.qkv_weight[:32].abs().sum() == 0


def test_activation_cache_helpers_run():
    model = tiny(use_attn_result=True)
    tokens = torch.randint(0, 49, (2, 6))
    logits, cache = model.run_with_cache(tokens)
    acc, labels = cache.accumulated_resid(incl_mid=True, return_labels=True, apply_ln=True)
    assert acc.shape[0] == len(labels) == 2 * 2 + 1
    dec, dlabels = cache.decompose_resid(return_labels=True)
    # the decomposition sums back to the final residual stream
    torch.testing.assert_close(dec.sum(0), cache["blocks.1.hook_resid_post"], atol=1e-4, rtol=1e-4)
    heads = cache.stack_head_results(layer=-1)
    assert heads.shape[0] == 2 * 4
    stacked = cache.stack_activation("pattern")
    assert stacked.shape == (2, 2, 4, 6, 6)
    scaled = cache.apply_ln_to_stack(dec, layer=-1)
    answer = torch.tensor([3, 7])
    assert scaled.shape == dec.shape
    # tokens given per (batch, pos): transformer-lens 3.x does not broadcast a [batch] answer over positions
    # (its logit_attrs wants tokens shaped like the stack's batch and pos dims); 4.x accepts both
    attrs = cache.logit_attrs(dec, tokens=answer[:, None].expand(2, 6))  # applies ln_final's scale itself
    assert attrs.shape == (dec.shape[0], 2, 6)
    # direct logit attribution is exact: the summed attributions equal the logits
    final = attrs.sum(0)[:, -1]
    torch.testing.assert_close(final, logits[torch.arange(2), -1, answer], atol=1e-3, rtol=1e-3)


def test_transformer_lens_generic_patching_runs():
    model = tiny()
    clean = torch.randint(0, 49, (1, 5))
    corrupt = clean.clone()
    corrupt[0, 1] = (clean[0, 1] + 3) % 49
    _, clean_cache = model.run_with_cache(clean)
    target = int(clean[0, -1])

    def metric(logits):
        return logits[0, -1, target]

    out = patching.get_act_patch_resid_pre(model, corrupt, clean_cache, metric)
    assert out.shape == (2, 5)
    # patching the corrupted position with its clean value at layer 0 restores the clean metric exactly
    with torch.no_grad():
        clean_metric = metric(model(clean)).item()
    assert abs(out[0, 1].item() - clean_metric) < 1e-4
