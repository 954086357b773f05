"""Hook points of the new families fire with the documented shapes, add up, and per-expert weights are
reachable by name (an index edit routes through exactly the experts named)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import write_llada2, write_lladamoe, write_sdar

from mdm_lens import HookedMDM
from mdm_lens.errors import HookNameError

B, T = 2, 7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"llada2": HookedMDM.from_pretrained(write_llada2(root / "llada2")[0]),
            "lladamoe": HookedMDM.from_pretrained(write_lladamoe(root / "lladamoe")[0]),
            "sdar_moe": HookedMDM.from_pretrained(write_sdar(root / "sdar_moe", moe=True)[0])}


@pytest.mark.parametrize("name,shared", [("llada2", True), ("lladamoe", True), ("sdar_moe", False)])
def test_hook_shapes_and_sums(models, name, shared):
    model = models[name]
    c = model.cfg
    spec = c.extra["moe"]
    tokens = torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(0))
    logits, cache = model.run_with_cache(tokens)  # caching the pattern takes the explicit attention path
    with torch.no_grad():
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=1e-5)  # = the SDPA path, block mask and all
    layer = 1  # every family's layer 1 is MoE, layer 0 dense (mlp_only_layers / first_k_dense_replace / freq)
    a, m = f"blocks.{layer}.attn.", f"blocks.{layer}.mlp."
    assert cache[a + "hook_q_normed"].shape == (B, T, c.n_heads, c.d_head)
    assert cache[a + "hook_k_normed"].shape == (B, T, c.n_key_value_heads, c.d_head)
    # the norm really ran: q_normed / w has unit RMS over each head
    unit = cache[a + "hook_q_normed"] / model.blocks[layer].attn.q_norm.w
    torch.testing.assert_close(unit.pow(2).mean(-1), torch.ones(B, T, c.n_heads), rtol=0, atol=1e-3)
    assert cache[m + "hook_router_logits"].shape == (B, T, spec["n_experts"])
    assert cache[m + "hook_expert_indices"].shape == (B, T, spec["top_k"])
    assert cache[m + "hook_expert_indices"].dtype == torch.long
    assert cache[m + "hook_expert_weights"].shape == (B, T, spec["top_k"])
    assert cache[m + "hook_experts_out"].shape == (B, T, c.d_model)
    mlp_out = cache[f"blocks.{layer}.hook_mlp_out"]
    if shared:
        assert cache[m + "hook_shared_out"].shape == (B, T, c.d_model)
        assert torch.equal(mlp_out, cache[m + "hook_experts_out"] + cache[m + "hook_shared_out"])
    else:
        assert m + "hook_shared_out" not in model.hook_dict
        assert torch.equal(mlp_out, cache[m + "hook_experts_out"])
    assert cache["blocks.0.mlp.hook_post"].shape == (B, T, c.d_mlp)  # the dense layer keeps TL's MLP hooks


def test_forced_experts_are_the_named_weights(models):
    model = models["llada2"]
    mlp = model.blocks[1].mlp
    tokens = torch.randint(0, 100, (1, T), generator=torch.Generator().manual_seed(3))
    forced = torch.tensor([3, 6]).expand(1, T, 2)
    captured = {}

    def keep(name):
        def hook(value, hook):
            captured[name] = value.detach().clone()
        return hook

    fwd = [("blocks.1.mlp.hook_expert_indices", lambda v, hook: forced.clone()),
           ("blocks.1.ln2.hook_normalized", keep("x")), ("blocks.1.mlp.hook_router_logits", keep("logits")),
           ("blocks.1.mlp.hook_experts_out", keep("out"))]
    model.run_with_hooks(tokens, fwd_hooks=fwd)
    x = captured["x"] * model.blocks[1].ln2.w
    scores = torch.sigmoid(captured["logits"])[..., [3, 6]]
    w = scores / (scores.sum(-1, keepdim=True) + 1e-20) * 2.5  # weights re-gathered for the forced experts
    expected = 0
    for slot, e in enumerate((3, 6)):
        expert = mlp.experts[e]  # per-expert TL views of blocks.1.mlp.experts.{e}.gate_up_weight / down_weight
        expected = expected + w[..., slot, None] * ((F.silu(x @ expert.W_gate) * (x @ expert.W_in)) @ expert.W_out)
    torch.testing.assert_close(captured["out"], expected, rtol=0, atol=1e-5)
    assert "blocks.1.mlp.experts.6.gate_up_weight" in model.state_dict()


def test_weight_views_and_output_bias(models):
    model = models["llada2"]
    c = model.cfg
    assert model.W_Q.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)
    assert model.W_K.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)  # kv heads repeated, as TL does
    assert model.b_O.shape == (c.n_layers, c.d_model) and float(model.b_O.detach().abs().sum()) > 0  # attention.dense.bias
    torch.testing.assert_close(model.accumulated_bias(2), model.b_O[0] + model.b_O[1], rtol=0, atol=0)
    torch.testing.assert_close(model.accumulated_bias(1, mlp_input=True), model.b_O[0] + model.b_O[1], rtol=0, atol=0)


def test_no_qk_norm_no_normed_hooks(tmp_path):
    model = HookedMDM.from_pretrained(write_lladamoe(tmp_path / "m", qk_layernorm=False)[0])
    assert "blocks.0.attn.hook_q_normed" not in model.hook_dict
    with pytest.raises(HookNameError):
        model.run_with_hooks(torch.zeros(1, 3, dtype=torch.long),
                             fwd_hooks=[("blocks.0.attn.hook_q_normed", lambda v, hook: v)])
