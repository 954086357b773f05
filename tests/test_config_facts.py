"""Config facts at load, table-driven: every config.json key a loader reads is set to a value unlike its default
and its neighbours, and the effect is checked (the cfg field, against the reference config class where one is
installed, or the logits against the independent reference forward of tests/families/family_reference.py).
Bad values of every family's keys are ConfigErrors naming the file, the key and the value."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).parent / "families"))
from family_checkpoints import (LLADA2_CONFIG, LLADAMOE_CONFIG, SDAR_CONFIG, SDAR_MOE_EXTRA,  # noqa: E402
                                _tokenizer_files, write_llada2, write_lladamoe)
from family_reference import llada2_forward, lladamoe_forward  # noqa: E402

from mdm_lens import HookedMDM  # noqa: E402
from mdm_lens.errors import ConfigError  # noqa: E402
from mdm_lens.loading import read_config  # noqa: E402

TOL = 1e-4
SDAR_MOE = {**SDAR_CONFIG, **SDAR_MOE_EXTRA}
FAST = {"architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen", "vocab_size": 101,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 1e6, "bd_size": 8}
BASES = {"llada2_moe": LLADA2_CONFIG, "lladamoe": LLADAMOE_CONFIG, "sdar": SDAR_CONFIG, "sdar_moe": SDAR_MOE,
         "fastdllm_v2": FAST}


def cfg_of(tmp_path: Path, base: dict, **overrides):
    """`read_config` of a folder holding only config.json and tokenizer files (no weights needed)."""
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**base, **overrides}))
    _tokenizer_files(folder, "<|mask|>")
    return read_config(folder, "t", None)[0]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))


# --- B: every value is type/range-checked; a bad one names the file, the key and the value -------------------
BAD = [("llada2_moe", "block_length", 0), ("llada2_moe", "block_length", -4), ("llada2_moe", "block_size", 0),
       ("llada2_moe", "block_size", "8"), ("llada2_moe", "routed_scaling_factor", float("nan")),
       ("llada2_moe", "routed_scaling_factor", -1.0), ("llada2_moe", "routed_scaling_factor", 0.0), ("llada2_moe", "partial_rotary_factor", 1.5),
       ("llada2_moe", "n_group", "4"), ("llada2_moe", "first_k_dense_replace", -1),
       ("llada2_moe", "num_shared_experts", 1.5), ("llada2_moe", "use_qk_norm", "yes"),
       ("lladamoe", "clip_qkv", -1.0), ("lladamoe", "moe_layer_freq", [0, "1", 1]), ("lladamoe", "rms_norm_eps", -1e-5),
       ("sdar", "block_length", 0), ("sdar", "block_size", "8"), ("sdar", "rope_theta", float("inf")),
       ("sdar_moe", "decoder_sparse_step", 0), ("sdar_moe", "num_local_experts", "8"),
       ("sdar_moe", "norm_topk_prob", 1), ("sdar_moe", "mlp_only_layers", [-1]), ("fastdllm_v2", "bd_size", 0),
       ("fastdllm_v2", "tie_word_embeddings", "false")]


@pytest.mark.parametrize("family,key,value", BAD, ids=[f"{f}.{k}={v!r}" for f, k, v in BAD])
def test_a_bad_value_is_a_config_error_naming_file_key_and_value(tmp_path, family, key, value):
    with pytest.raises(ConfigError) as info:
        cfg_of(tmp_path, BASES[family], **{key: value})
    message = str(info.value)
    assert "config.json" in message and f"{key}=" in message and "expected" in message, message


@pytest.mark.parametrize("family", ["llada2_moe", "sdar"])
def test_block_length_read_as_given_and_two_disagreeing_keys_refused(tmp_path, family):
    assert cfg_of(tmp_path, BASES[family], block_length=16).extra["block_length"] == 16
    assert cfg_of(tmp_path, BASES[family], block_size=8).extra["block_length"] == 8
    with pytest.raises(ConfigError, match="disagree"):
        cfg_of(tmp_path, BASES[family], block_length=16, block_size=8)


@pytest.mark.parametrize("overrides,match", [(dict(n_group=3), "not divisible by n_group"),
                                             (dict(topk_group=5), "exceeds n_group"),
                                             (dict(num_experts_per_tok=5, topk_group=1), "exceeds the 2 experts")])
def test_llada2_routing_that_cannot_run_is_refused(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_of(tmp_path, LLADA2_CONFIG, **overrides)


# --- A: facts, against the reference config classes ---------------------------------------------------------
@pytest.mark.parametrize("family", list(BASES))
def test_list_valued_eos_first_wins(tmp_path, family):
    cfg = cfg_of(tmp_path, BASES[family], eos_token_id=[97, 98])
    assert cfg.eos_token_id == 97 and cfg.extra["eos_token_ids"] == [97, 98]


@pytest.mark.parametrize("family", list(BASES))
def test_norm_eps_and_tying_read(tmp_path, family):
    cfg = cfg_of(tmp_path, BASES[family], rms_norm_eps=0.037, tie_word_embeddings=True)
    assert cfg.norm_eps == pytest.approx(0.037) and cfg.tie_word_embeddings is True


def test_head_dim_read_where_the_reference_reads_it_and_ignored_where_not(tmp_path):
    assert cfg_of(tmp_path, SDAR_CONFIG, head_dim=24).d_head == Qwen3Config(head_dim=24).head_dim == 24
    assert cfg_of(tmp_path, SDAR_MOE, head_dim=24).d_head == 24
    # LLaDA-MoE's attention uses hidden_size // heads whatever head_dim says (modeling_lladamoe)
    assert cfg_of(tmp_path, LLADAMOE_CONFIG, head_dim=24).d_head == 64 // 4


@pytest.mark.parametrize("step,only", [(1, [0]), (2, []), (2, [1]), (3, [0]), (3, [5])])
def test_sdar_moe_sparse_step_matches_qwen3_moe(tmp_path, step, only):
    n = 6
    cfg = cfg_of(tmp_path, SDAR_MOE, num_hidden_layers=n, decoder_sparse_step=step, mlp_only_layers=only)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=n,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=8,
                                             decoder_sparse_step=step, mlp_only_layers=only))
    expected = [type(layer.mlp).__name__ != "Qwen3MoeMLP" for layer in ref.model.layers]
    assert cfg.extra["moe_layers"] == expected and any(expected) and not all(expected) or step == 1


def test_sdar_moe_num_local_experts_is_the_reference_alias(tmp_path):
    raw = {k: v for k, v in SDAR_MOE.items() if k != "num_experts"}
    assert Qwen3MoeConfig(num_local_experts=6).num_experts == 6
    assert cfg_of(tmp_path, raw, num_local_experts=6).extra["moe"]["n_experts"] == 6
    with pytest.raises(ConfigError, match="num_local_experts=6.*disagree"):
        cfg_of(tmp_path, SDAR_MOE, num_local_experts=6)


def test_sdar_moe_norm_topk_prob_read(tmp_path):
    assert cfg_of(tmp_path, SDAR_MOE, norm_topk_prob=False).extra["moe"]["renorm"] is False
    assert cfg_of(tmp_path, SDAR_MOE, norm_topk_prob=True).extra["moe"]["renorm"] is True


def test_two_rope_keys_the_top_level_original_length_wins(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 101, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": scaling,
             "max_position_embeddings": 512}
    both = cfg_of(tmp_path, llama, original_max_position_embeddings=128).extra["rope_scaling"]
    inner = cfg_of(tmp_path, llama).extra["rope_scaling"]
    assert both["original_max_position_embeddings"] == 128 and inner["original_max_position_embeddings"] == 64
    assert LlamaConfig(**{k: v for k, v in llama.items() if k != "architectures"}).rope_parameters["factor"] == 8.0
    linear = cfg_of(tmp_path, llama, rope_scaling={"rope_type": "linear", "factor": 2.5}).extra["rope_scaling"]
    assert linear == {"rope_type": "linear", "factor": 2.5}


# --- A: keys that change the math, against the independent reference forwards -------------------------------
LLADA2_MATH = [dict(routed_scaling_factor=1.7), dict(n_group=2, topk_group=1), dict(partial_rotary_factor=0.25),
               dict(rms_norm_eps=0.3), dict(first_k_dense_replace=2), dict(num_experts_per_tok=3, n_group=2,
                                                                           topk_group=2)]


@pytest.mark.parametrize("overrides", LLADA2_MATH, ids=[",".join(o) for o in LLADA2_MATH])
def test_llada2_keys_change_the_logits_as_the_reference(tmp_path, overrides):
    folder, config, sd = write_llada2(tmp_path / "m", **overrides)
    model = HookedMDM.from_pretrained(folder)
    tokens = _tokens()
    ref = llada2_forward(sd, config, tokens, None)
    base = llada2_forward(sd, LLADA2_CONFIG | {k: v for k, v in config.items() if k == "first_k_dense_replace"}, tokens)
    assert (model(tokens, block_length=tokens.shape[1]) - ref).abs().max() <= TOL
    assert (ref - base).abs().max() > 100 * TOL or "first_k_dense_replace" in overrides  # the key matters


LLADAMOE_MATH = [dict(clip_qkv=0.3), dict(rms_norm_eps=0.3), dict(partial_rotary_factor=1.0),
                 dict(norm_topk_prob=True), dict(head_dim=8)]


@pytest.mark.parametrize("overrides", LLADAMOE_MATH, ids=[",".join(o) for o in LLADAMOE_MATH])
def test_lladamoe_keys_change_the_logits_as_the_reference(tmp_path, overrides):
    folder, config, sd = write_lladamoe(tmp_path / "m", **overrides)
    model = HookedMDM.from_pretrained(folder)
    tokens = _tokens()
    # norm_topk_prob and head_dim are read by no LLaDA-MoE reference code: the reference forward ignores them too
    assert (model(tokens) - lladamoe_forward(sd, config, tokens)).abs().max() <= TOL
    assert not math.isnan(float(model(tokens).detach().sum()))


def test_sdar_moe_without_norm_topk_prob_takes_qwen3_moes_default(tmp_path):
    """Qwen3MoeConfig's default is norm_topk_prob=False: an absent key must not renormalise the top-k weights."""
    from transformers import Qwen3MoeConfig

    base = {k: v for k, v in SDAR_MOE.items() if k != "norm_topk_prob"}
    cfg = cfg_of(tmp_path, base)
    assert cfg.extra["moe"]["renorm"] is False and Qwen3MoeConfig().norm_topk_prob is False
    assert cfg_of(tmp_path, base, norm_topk_prob=True).extra["moe"]["renorm"] is True
