"""The bridge on transformers' own DiffusionGemmaForBlockDiffusion: logits equal transformers' (fp32,
≤1e-4) across layer types, GQA, MoE, softcapping, self-conditioning and padding; patterns equal eager
`output_attentions`; hooks edit the computation; names and errors."""

from __future__ import annotations

import copy

import pytest
import torch
from transformer_lens import ActivationCache
from transformers import DynamicCache

from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import HookNameError, InputError

TOL = 1e-4
CASES = {
    "default": {},
    "mha_no_global_kv": dict(n_kv_heads=4, global_kv_heads=None),
    "strong_softcap": dict(softcap=2.0),
    "all_full": dict(layer_types=["full_attention", "full_attention"], n_layers=2),
    "wide_window": dict(sliding_window=64, top_k_experts=1),
}


def _pair(seed: int = 0, **kw):
    ref = tiny_diffusion_gemma(seed=seed, **kw)
    return ref, TransformersBridge(copy.deepcopy(ref))


def _inputs(batch=2, prompt=7, canvas=8, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt), generator=g), torch.randint(0, vocab, (batch, canvas), generator=g)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("self_cond", [False, True])
def test_logits_equal_transformers(case, self_cond):
    ref, bridge = _pair(**CASES[case])
    ids, canvas = _inputs()
    kw = {}
    if self_cond:
        kw["self_conditioning_logits"] = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(3)) * 3
    with torch.no_grad():
        expected = ref(input_ids=ids, decoder_input_ids=canvas, **kw).logits
        ours = bridge(ids, decoder_input_ids=canvas, **kw)
        bridge.set_force_explicit(True)
        explicit = bridge(ids, decoder_input_ids=canvas, **kw)
    assert ours.shape == (2, 8, 128)
    assert (ours - expected).abs().max().item() <= TOL
    assert (explicit - expected).abs().max().item() <= TOL
    if case == "strong_softcap":  # the cap binds: |logit| < 2
        assert ours.abs().max().item() < 2.0


def test_self_conditioning_changes_logits():
    """Guards the test above: the self-conditioning path is live in these tiny models."""
    ref, bridge = _pair()
    ids, canvas = _inputs()
    with torch.no_grad():
        a = bridge(ids, decoder_input_ids=canvas)
        b = bridge(ids, decoder_input_ids=canvas, self_conditioning_logits=torch.randn(2, 8, 128) * 3)
    assert (a - b).abs().max().item() > 1e-2


def test_left_padding_equals_transformers():
    ref, bridge = _pair()
    ids, canvas = _inputs()
    am = torch.ones_like(ids)
    am[0, :3] = 0
    dam = torch.nn.functional.pad(am, (0, 8), value=1)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=am, decoder_input_ids=canvas, decoder_attention_mask=dam).logits
        bridge.set_force_explicit(True)
        ours = bridge(ids, attention_mask=am, decoder_input_ids=canvas, decoder_attention_mask=dam)
        ids2 = ids.clone()
        ids2[0, :3] = 5  # pads are hidden: changing them moves nothing
        ours2 = bridge(ids2, attention_mask=am, decoder_input_ids=canvas, decoder_attention_mask=dam)
    assert (ours - expected).abs().max().item() <= TOL
    # fp32 rounding of hidden rows scales with the logits (log-normal norm weights and layer scalars): relative
    scale = max(1.0, ours.abs().max().item())
    assert (ours2 - ours).abs().max().item() <= 1e-5 * scale


def test_patterns_equal_eager_output_attentions():
    ref, bridge = _pair()
    ref.set_attn_implementation("eager")
    ids, canvas = _inputs(prompt=7)
    with torch.no_grad():
        out = ref(input_ids=ids, decoder_input_ids=canvas, output_attentions=True)
        _, cache = bridge.run_with_cache(ids, decoder_input_ids=canvas, names_filter=lambda n: "pattern" in n)
    assert isinstance(cache, ActivationCache)
    for layer, eager in enumerate(out.attentions):
        ours = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert ours.shape == (2, 4, 8, 15)  # absolute keys: 7 prompt + 8 canvas
        n = eager.shape[-1]  # sliding layers keep only the last window-1 prompt keys
        # fp32 softmax over differently ordered reductions (SDPA-style vs eager matmul): a few 1e-6 per weight
        assert (ours[..., -n:] - eager).abs().max().item() <= 5e-5
        assert ours[..., : 15 - n].abs().sum().item() == 0.0
    assert [a.shape[-1] for a in out.attentions] == [11, 15, 15]  # the window really bites on layer 0
    assert cache["encoder.0.attn.hook_pattern"].shape == (2, 4, 7, 7)
    assert torch.allclose(cache["encoder.0.attn.hook_pattern"].triu(1), torch.zeros(()))  # causal encoder


def test_hooks_edit_the_computation_and_are_removed():
    ref, bridge = _pair()
    ids, canvas = _inputs()
    with torch.no_grad():
        clean = bridge(ids, decoder_input_ids=canvas)
        zeroed = bridge.run_with_hooks(ids, decoder_input_ids=canvas,
                                       fwd_hooks=[("blocks.2.hook_resid_post", lambda x, hook: x * 0)])
        again = bridge(ids, decoder_input_ids=canvas)
        # the final norm of a zero residual is zero, so the logits are exactly zero
        assert zeroed.abs().max().item() == 0.0
        assert (again - clean).abs().max().item() == 0.0
        # knocking out the prompt keys in every decoder layer changes the canvas logits
        def drop_prompt(p, hook):
            p = p.clone()
            p[..., :7] = 0
            return p
        knocked = bridge.run_with_hooks(ids, decoder_input_ids=canvas,
                                        fwd_hooks=[(lambda n: n.endswith("attn.hook_pattern") and n.startswith("blocks"),
                                                    drop_prompt)])
    assert (knocked - clean).abs().max().item() > 1e-3
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())


def test_router_hooks_and_moe_routing():
    ref, bridge = _pair()
    ids, canvas = _inputs()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, decoder_input_ids=canvas)
        logits = cache["blocks.1.mlp.hook_router_logits"]
        idx = cache["blocks.1.mlp.hook_expert_indices"]
        w = cache["blocks.1.mlp.hook_expert_weights"]
        assert logits.shape == (2, 8, 4) and idx.shape == (2, 8, 2) and w.shape == (2, 8, 2)
        assert torch.equal(idx, logits.softmax(-1).topk(2, dim=-1).indices)
        per_expert = bridge.hf.model.decoder.layers[1].router.per_expert_scale
        assert torch.allclose(w / per_expert[idx], (w / per_expert[idx]).sum(-1, keepdim=True) * 0 + 0.5, atol=0.5)
        assert torch.allclose((w / per_expert[idx]).sum(-1), torch.ones(2, 8), atol=1e-5)
        # the mlp output is the post-normed sum of the two branches
        layer = bridge.hf.model.decoder.layers[1]
        both = cache["blocks.1.mlp.hook_dense_out"] + cache["blocks.1.mlp.hook_experts_out"]
        assert torch.allclose(layer.post_feedforward_layernorm(both), cache["blocks.1.hook_mlp_out"], atol=1e-6)
        # resid_post = (resid_mid + mlp_out) * layer_scalar
        post = (cache["blocks.1.hook_resid_mid"] + cache["blocks.1.hook_mlp_out"]) * layer.layer_scalar
        assert torch.allclose(post, cache["blocks.1.hook_resid_post"], atol=1e-6)


def test_cache_prefix_only_decoder_pass_equals_transformers():
    """The sampler's call: encode once into a cache, then decoder passes that read it."""
    ref, bridge = _pair()
    ids, canvas = _inputs()
    c_ref = DynamicCache(config=ref.config.get_text_config(decoder=True))
    c_ours = DynamicCache(config=bridge.hf.config.get_text_config(decoder=True))
    with torch.no_grad():
        ref.model.encoder(input_ids=ids, cache=c_ref)
        bridge.encode(ids, c_ours)
        expected = ref(decoder_input_ids=canvas, cache=c_ref).logits
        bridge.set_force_explicit(True)
        ours = bridge(decoder_input_ids=canvas, cache=c_ours)
    assert (ours - expected).abs().max().item() <= TOL


def test_names_and_errors():
    _, bridge = _pair()
    names = list(bridge.hook_dict)
    assert "blocks.0.attn.hook_pattern" in names and "encoder.0.attn.hook_pattern" in names
    assert "hook_soft_embed" in names and "blocks.0.mlp.hook_router_logits" in names
    assert not any(n.startswith("hf.") for n in names)
    ids, canvas = _inputs()
    with pytest.raises(HookNameError, match="blocks.0.attn.hook_pattern"):
        bridge.run_with_hooks(ids, decoder_input_ids=canvas, fwd_hooks=[("blocks.0.attn.hook_patern", lambda x, hook: x)])
    with pytest.raises(InputError, match="decoder_input_ids"):
        bridge(ids)
    with pytest.raises(InputError, match=r"\[0, 128\)"):
        bridge(ids, decoder_input_ids=canvas + 200)
    with pytest.raises(InputError, match="cache"):
        bridge(decoder_input_ids=canvas)


def test_bridge_shares_the_checked_hook_surface():
    # the same checks as HookedMDM (mdm_lens.hook_surface): typed errors before any hook is added
    from mdm_lens.errors import ArgumentTypeError

    _, bridge = _pair()
    ids, canvas = _inputs()
    with pytest.raises(HookNameError, match="`encoder.{l}` the encoder"):
        bridge.run_with_cache(ids, decoder_input_ids=canvas, names_filter=["blocks.0.attn.hook_patern"])
    with pytest.raises(ArgumentTypeError, match="names_filter"):
        bridge.run_with_cache(ids, decoder_input_ids=canvas, names_filter=3)
    with pytest.raises(ArgumentTypeError, match="remove_batch_dim"):
        bridge.run_with_cache(ids, decoder_input_ids=canvas, remove_batch_dim="yes")
    with pytest.raises(ArgumentTypeError, match="one pair, not a list"):
        with bridge.hooks(fwd_hooks=("blocks.0.hook_resid_pre", lambda x, hook: x)):
            pass
    assert not any(hp.fwd_hooks for hp in bridge.hook_dict.values())
    _, cache = bridge.run_with_cache(ids, decoder_input_ids=canvas, names_filter="blocks.0.attn.hook_pattern")
    assert list(cache.keys()) == ["blocks.0.attn.hook_pattern"]


def _torch_hooks(module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


def test_unhooked_layers_run_transformers_own_code_and_taps_come_and_go():
    """Speed paths: a block with no hook runs transformers' own layer forward, and submodule taps are torch
    hooks only while hooked. Both must leave the numbers as they were."""
    ref, bridge = _pair()
    ids, canvas = _inputs()
    dec = bridge.hf.model.decoder
    q_norm, router = dec.layers[1].self_attn.q_norm, dec.layers[1].router.proj
    assert _torch_hooks(q_norm) == _torch_hooks(router) == _torch_hooks(dec.norm) == 0
    seen = []
    with torch.no_grad(), bridge.hooks(fwd_hooks=[("blocks.1.attn.hook_q", lambda x, hook: seen.append(x.clone())),
                                                  ("blocks.1.mlp.hook_router_logits", lambda x, hook: x)]):
        assert _torch_hooks(q_norm) == 1 and _torch_hooks(router) == 1
        assert not bridge.blocks[1].active()                # attention points and taps need no wrapper
        bridge.add_hook("blocks.1.hook_mlp_out", lambda x, hook: seen.append(x.shape))
        assert bridge.blocks[1].active() and not bridge.blocks[0].active()
        mixed = bridge(ids, decoder_input_ids=canvas)      # block 1 wrapped, blocks 0 and 2 transformers'
        assert seen[-1] == (2, 8, 32)
    assert _torch_hooks(q_norm) == _torch_hooks(router) == 0   # the context's own hooks are gone
    bridge.reset_hooks()                                     # and the one added by hand
    assert not bridge.blocks[1].active()
    assert seen and seen[0].shape == (2, 8, 4, 16)          # [batch, canvas, head, d_head]: layer 1 is full (hd 16)
    with torch.no_grad():
        plain = bridge(ids, decoder_input_ids=canvas)
        theirs = ref(input_ids=ids, decoder_input_ids=canvas).logits
        # every block through the hooked wrapper: a hook on each block that returns nothing
        names = [n for n in bridge.hook_dict if n.startswith("blocks.") and ".attn." not in n
                 and "router_logits" not in n]
        fired = []
        wrapped = bridge.run_with_hooks(ids, decoder_input_ids=canvas,
                                        fwd_hooks=[(n, lambda x, hook: fired.append(hook.name)) for n in names])
        assert sorted(fired) == sorted(names)               # every wrapper point fires, once
    assert torch.equal(plain, theirs)                        # unhooked: transformers' code, the same bits
    assert torch.equal(mixed, theirs) and torch.equal(wrapped, theirs)  # the wrapper is line for line
    # unbridge removes the taps too
    bridge.add_hook("ln_final.hook_out", lambda x, hook: x)
    assert _torch_hooks(dec.norm) == 1
    bridge.unbridge()
    assert _torch_hooks(dec.norm) == 0 and "forward" not in dec.layers[1].__dict__
