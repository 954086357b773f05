"""Tiny random checkpoints of LLaDA2.x, LLaDA-MoE and SDAR / SDAR-MoE in their hub layouts (key names and
config.json keys as the released files have them), plus minimal tokenizer files naming the mask token."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdm_lens.init import bias_draw, norm_weight_draw

VOCAB = 101
MASK_ID = 100


def _rand(g: torch.Generator, *shape: int, scale: float = 0.08) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=g)


def _norm(g: torch.Generator, n: int, near_one: bool = False) -> torch.Tensor:
    """The library's fixture (log-normal, far from 1, so a skipped norm shows); `near_one`: see `write_llada2`."""
    return 1.0 + 0.1 * torch.randn(n, generator=g) if near_one else norm_weight_draw((n,), g)


def _bias(g: torch.Generator, n: int, near_one: bool = False, scale: float = 0.08) -> torch.Tensor:
    """The library's fixture (biases and router biases std 0.1); `near_one`: the old normal(0, scale) draw."""
    return _rand(g, n, scale=scale) if near_one else bias_draw((n,), 0.1, g)


def _mlp(sd: dict, g: torch.Generator, prefix: str, d: int, f: int) -> None:
    sd[prefix + "gate_proj.weight"] = _rand(g, f, d)
    sd[prefix + "up_proj.weight"] = _rand(g, f, d)
    sd[prefix + "down_proj.weight"] = _rand(g, d, f)


def _tokenizer_files(folder: Path, mask_name: str, mask_in_config: bool = True) -> None:
    tok = {"added_tokens_decoder": {str(MASK_ID): {"content": mask_name, "special": True}}}
    if mask_in_config:
        tok["mask_token"] = mask_name
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))


def _write(folder: Path, config: dict, sd: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return folder


LLADA2_CONFIG = dict(
    architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe",
    auto_map={"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, use_qkv_bias=True, use_qk_norm=True, use_bias=True, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=512, rope_theta=600000.0, partial_rotary_factor=0.5,
    num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, moe_intermediate_size=24, first_k_dense_replace=1, pad_token_id=99, eos_token_id=98,
)


def write_llada2(folder: Path, seed: int = 0, drop: tuple[str, ...] = (), init: str = "realistic",
                 **overrides) -> tuple[Path, dict, dict]:
    """(folder, config as written, hub state dict).

    `init="near_one"` redraws the weights the pre-fixture way (norms 1 + 0.1·N, biases 0.08·N; the generator is
    consumed identically, so matrices are the same): only for the LLaDA2 sampler tests whose planted EOS tokens and
    control-flow scenarios were picked from those weights' outputs. Never for a forward-exactness test."""
    near_one = {"realistic": False, "near_one": True}[init]
    config = {**LLADA2_CONFIG, **overrides}
    for key in drop:
        config.pop(key)
    full = {**LLADA2_CONFIG, **overrides}
    g = torch.Generator().manual_seed(seed)
    d, h, kv, e = full["hidden_size"], full["num_attention_heads"], full["num_key_value_heads"], full["head_dim"]
    sd = {"model.word_embeddings.weight": _rand(g, VOCAB, d, scale=1.0), "model.norm.weight": _norm(g, d, near_one)}
    if not full["tie_word_embeddings"]:
        sd["lm_head.weight"] = _rand(g, VOCAB, d, scale=0.3)
    for i in range(full["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, d, near_one)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, d, near_one)
        sd[p + "attention.query_key_value.weight"] = _rand(g, (h + 2 * kv) * e, d)
        if full["use_qkv_bias"]:
            sd[p + "attention.query_key_value.bias"] = _bias(g, (h + 2 * kv) * e, near_one)
        sd[p + "attention.dense.weight"] = _rand(g, d, h * e)
        if full["use_bias"]:
            sd[p + "attention.dense.bias"] = _bias(g, d, near_one)
        if full["use_qk_norm"]:
            sd[p + "attention.query_layernorm.weight"] = _norm(g, e, near_one)
            sd[p + "attention.key_layernorm.weight"] = _norm(g, e, near_one)
        if i < full["first_k_dense_replace"]:
            _mlp(sd, g, p + "mlp.", d, full["intermediate_size"])
            continue
        n, f = full["num_experts"], full["moe_intermediate_size"]
        sd[p + "mlp.gate.weight"] = _rand(g, n, d, scale=0.3)
        sd[p + "mlp.gate.expert_bias"] = _bias(g, n, near_one, scale=0.1)
        for x in range(n):
            _mlp(sd, g, f"{p}mlp.experts.{x}.", d, f)
        if full["num_shared_experts"]:
            _mlp(sd, g, p + "mlp.shared_experts.", d, f * full["num_shared_experts"])
    _write(folder, config, sd)
    _tokenizer_files(folder, "<|mask|>")
    return folder, full, sd


LLADAMOE_CONFIG = dict(
    architectures=["LLaDAMoEModelLM"], model_type="llada",
    auto_map={"AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"},
    vocab_size=VOCAB, hidden_size=64, dense_intermediate_size=96, expert_intermediate_size=24,
    shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=99, eos_token_id=98,
    tie_word_embeddings=False, rope_theta=50000, partial_rotary_factor=0.5, attention_bias=True, clip_qkv=1.5,
    num_experts_per_tok=2, num_experts=8, norm_topk_prob=False, qk_layernorm=True, moe_layer_freq=[0, 1, 1],
    moe_router_enable_expert_bias=True, moe_router_score_function="softmax", routed_scaling_factor=1,
    router_num_group=1, router_topk_group=1,
)


def write_lladamoe(folder: Path, seed: int = 0, drop: tuple[str, ...] = (), **overrides) -> tuple[Path, dict, dict]:
    config = {**LLADAMOE_CONFIG, **overrides}
    for key in drop:
        config.pop(key)
    full = {**LLADAMOE_CONFIG, **overrides}
    g = torch.Generator().manual_seed(seed)
    d, h = full["hidden_size"], full["num_attention_heads"]
    kv = full["num_key_value_heads"] or h
    e = d // h
    sd = {"model.embed_tokens.weight": _rand(g, VOCAB, d, scale=1.0), "model.norm.weight": _norm(g, d)}
    if not full["tie_word_embeddings"]:
        sd["lm_head.weight"] = _rand(g, VOCAB, d, scale=0.3)
    for i in range(full["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, d)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, d)
        for name, rows in (("q", h * e), ("k", kv * e), ("v", kv * e)):
            sd[f"{p}self_attn.{name}_proj.weight"] = _rand(g, rows, d, scale=0.3)
            if full["attention_bias"]:
                sd[f"{p}self_attn.{name}_proj.bias"] = _bias(g, rows)
        sd[p + "self_attn.o_proj.weight"] = _rand(g, d, h * e)
        if full["attention_bias"]:
            sd[p + "self_attn.o_proj.bias"] = _bias(g, d)
        if full["qk_layernorm"]:
            sd[p + "self_attn.q_norm.weight"] = _norm(g, e)
            sd[p + "self_attn.k_norm.weight"] = _norm(g, e)
        if not full["moe_layer_freq"][i]:
            _mlp(sd, g, p + "mlp.", d, full["dense_intermediate_size"])
            continue
        n = full["num_experts"]
        sd[p + "mlp.gate.weight"] = _rand(g, n, d, scale=0.3)
        if full["moe_router_enable_expert_bias"]:
            sd[p + "mlp.expert_bias"] = _bias(g, n)
        for x in range(n):
            _mlp(sd, g, f"{p}mlp.experts.{x}.", d, full["expert_intermediate_size"])
        if full["shared_expert_intermediate_size"] is not None:
            _mlp(sd, g, p + "shared_expert.", d, full["shared_expert_intermediate_size"])
    _write(folder, config, sd)
    _tokenizer_files(folder, "<|mask|>")
    return folder, full, sd


SDAR_CONFIG = dict(
    architectures=["SDARForCausalLM"], model_type="sdar", auto_map={"AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_theta=1000000.0, attention_bias=False, use_sliding_window=False,
    bos_token_id=97, eos_token_id=98,
)
SDAR_MOE_EXTRA = dict(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe",
                      auto_map={"AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"}, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[0])


def write_sdar(folder: Path, moe: bool = False, seed: int = 0, **overrides) -> tuple[Path, dict, dict]:
    config = {**SDAR_CONFIG, **(SDAR_MOE_EXTRA if moe else {}), **overrides}
    g = torch.Generator().manual_seed(seed)
    d, h, kv, e = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    sd = {"model.embed_tokens.weight": _rand(g, VOCAB, d, scale=1.0), "model.norm.weight": _norm(g, d)}
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = _rand(g, VOCAB, d, scale=0.3)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, d)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, d)
        for name, rows in (("q", h * e), ("k", kv * e), ("v", kv * e)):
            sd[f"{p}self_attn.{name}_proj.weight"] = _rand(g, rows, d, scale=0.2)
            if config["attention_bias"]:
                sd[f"{p}self_attn.{name}_proj.bias"] = _bias(g, rows)
        sd[p + "self_attn.o_proj.weight"] = _rand(g, d, h * e)
        if config["attention_bias"]:
            sd[p + "self_attn.o_proj.bias"] = _bias(g, d)
        sd[p + "self_attn.q_norm.weight"] = _norm(g, e)
        sd[p + "self_attn.k_norm.weight"] = _norm(g, e)
        if not moe or i in config["mlp_only_layers"]:
            _mlp(sd, g, p + "mlp.", d, config["intermediate_size"])
            continue
        sd[p + "mlp.gate.weight"] = _rand(g, config["num_experts"], d, scale=0.3)
        for x in range(config["num_experts"]):
            _mlp(sd, g, f"{p}mlp.experts.{x}.", d, config["moe_intermediate_size"])
    _write(folder, config, sd)
    _tokenizer_files(folder, "<|MASK|>", mask_in_config=False)  # found by its name, as in SDAR's vocabulary
    return folder, config, sd


def block_additive_mask(n: int, block_length: int) -> torch.Tensor:
    """The samplers' mask (dllm LLaDA2 / SDAR generate.py): tril over blocks, repeated, as 0 / -inf."""
    n_blocks = -(-n // block_length)
    blocks = torch.tril(torch.ones(n_blocks, n_blocks))
    full = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[:n, :n]
    return full.log()[None, None]
