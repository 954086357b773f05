"""LLaDA2.x, LLaDA-MoE, SDAR and SDAR-MoE load from their hub layouts and match independent references in fp32:
LLaDA2 / LLaDA-MoE against the plain-torch transcriptions in family_reference.py, SDAR / SDAR-MoE against
transformers' Qwen3 / Qwen3-MoE run with the samplers' 4-D block mask."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import MASK_ID, block_additive_mask, write_llada2, write_lladamoe, write_sdar
from family_reference import llada2_forward, lladamoe_forward

from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError

TOL = 1e-4


def _tokens(batch: int = 2, n: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [
    {},
    # other paths: no q/k/v or dense bias, no shared expert, plain top-k (one group), top-1 (no renormalisation)
    dict(use_qkv_bias=False, use_bias=False, num_shared_experts=0, n_group=1, topk_group=1, num_experts_per_tok=1),
    dict(tie_word_embeddings=True, use_qk_norm=False, partial_rotary_factor=1.0, first_k_dense_replace=0),
])
def test_llada2_matches_reference(tmp_path, overrides):
    folder, config, sd = write_llada2(tmp_path / "llada2", **overrides)
    if config["tie_word_embeddings"]:
        sd["lm_head.weight"] = sd["model.word_embeddings.weight"]
    model = HookedMDM.from_pretrained(folder)
    tokens = _tokens()
    with torch.no_grad():
        blocked = model(tokens, block_length=4)
        full = model(tokens, block_length=tokens.shape[1])
    assert (blocked - llada2_forward(sd, config, tokens, block_additive_mask(11, 4))).abs().max() <= TOL
    assert (full - llada2_forward(sd, config, tokens, None)).abs().max() <= TOL
    assert (blocked - full).abs().max() > 1e-2  # the block mask matters on these weights


def test_llada2_config_facts(tmp_path):
    folder, config, sd = write_llada2(tmp_path / "llada2", drop=("partial_rotary_factor", "routed_scaling_factor",
                                                                 "use_bias", "pad_token_id"))
    model = HookedMDM.from_pretrained(folder)
    cfg = model.cfg
    # absent keys: LLaDA2MoeConfig defaults (partial_rotary_factor 0.5, routed_scaling_factor 2.5, use_bias True)
    assert cfg.extra["rotary_dim"] == 8 and cfg.extra["moe"]["scaling"] == 2.5 and cfg.extra["o_bias"] is True
    assert cfg.mask_token_id == MASK_ID and cfg.eos_token_id == 98
    assert cfg.pad_token_id is None  # the reference default 126081 lies outside this vocabulary
    assert cfg.extra["block_length"] == 32 and cfg.family == "llada2_moe" and cfg.attention == "block_causal"
    assert cfg.extra["moe_layers"] == [False, True, True]
    tokens = _tokens()
    ref = llada2_forward(sd, {**config, "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5}, tokens,
                         block_additive_mask(11, 32))
    assert (model(tokens) - ref).abs().max() <= TOL  # model(tokens) applies the default block length


def test_llada2_block_length_from_checkpoint(tmp_path):
    folder, _, _ = write_llada2(tmp_path / "llada2", block_length=8)
    assert HookedMDM.from_pretrained(folder).cfg.extra["block_length"] == 8


@pytest.mark.parametrize("overrides", [
    {},
    dict(clip_qkv=None, attention_bias=False, moe_router_enable_expert_bias=False, shared_expert_intermediate_size=None,
         partial_rotary_factor=1.0, num_key_value_heads=2),
    dict(qk_layernorm=False, moe_layer_freq=[1, 1, 1]),
])
def test_lladamoe_matches_reference(tmp_path, overrides):
    folder, config, sd = write_lladamoe(tmp_path / "lladamoe", **overrides)
    model = HookedMDM.from_pretrained(folder)
    assert model.cfg.family == "lladamoe" and "block_length" not in model.cfg.extra
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
    ref = lladamoe_forward(sd, config, tokens)
    assert (ours - ref).abs().max() <= TOL


def test_lladamoe_dispatches_on_architectures_and_refuses_sentinels(tmp_path):
    folder, _, _ = write_lladamoe(tmp_path / "ok")
    assert HookedMDM.from_pretrained(folder).cfg.extra["arch"] == "lladamoe"  # model_type is "llada"
    folder, _, _ = write_lladamoe(tmp_path / "bad", drop=("rope_theta",))
    with pytest.raises(ConfigError, match="rope_theta=-1"):  # LLaDAMoEConfig's default is the sentinel -1
        HookedMDM.from_pretrained(folder)


def _qwen3_reference(config: dict, sd: dict, moe: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")}
    rc = Qwen3MoeConfig(**keys) if moe else Qwen3Config(**keys)
    rc._attn_implementation = "eager"
    ref = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(rc)
    state = {k: v for k, v in sd.items() if k in ref.state_dict()}
    for i in range(config["num_hidden_layers"] if moe else 0):  # transformers 5 stacks the experts on load
        if i in config["mlp_only_layers"]:
            continue
        p, n = f"model.layers.{i}.mlp.", config["num_experts"]
        state[p + "experts.gate_up_proj"] = torch.stack([torch.cat([sd[f"{p}experts.{e}.gate_proj.weight"],
                                                                    sd[f"{p}experts.{e}.up_proj.weight"]]) for e in range(n)])
        state[p + "experts.down_proj"] = torch.stack([sd[f"{p}experts.{e}.down_proj.weight"] for e in range(n)])
    ref.load_state_dict(state, strict=True)
    return ref.eval()


@pytest.mark.parametrize("moe", [False, True])
def test_sdar_matches_transformers_qwen3(tmp_path, moe):
    folder, config, sd = write_sdar(tmp_path / "sdar", moe=moe)
    model = HookedMDM.from_pretrained(folder)
    assert model.cfg.mask_token_id == MASK_ID and model.cfg.extra["block_length"] == 4
    assert model.cfg.family == ("sdar_moe" if moe else "sdar")
    ref = _qwen3_reference(config, sd, moe)
    tokens = _tokens()
    mask = block_additive_mask(11, 4).expand(2, 1, 11, 11)
    with torch.no_grad():
        expected = ref(tokens, attention_mask=mask).logits
        causal = ref(tokens).logits
        ours = model(tokens)
    assert (ours - expected).abs().max() <= TOL
    assert (ours - causal).abs().max() > 1e-2  # the reference really ran the block mask, not its causal default


def test_sdar_head_dim_default(tmp_path):
    # SDARConfig's head_dim default is 128 (not hidden // heads): a config.json without it means 128
    folder, _, _ = write_sdar(tmp_path / "sdar", head_dim=128)
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("head_dim")
    path.write_text(json.dumps(config))
    assert HookedMDM.from_pretrained(folder).cfg.d_head == 128
