"""Tiny random checkpoints of RND1 (`RND1LM`) and CoDA (`CoDALanguageModel`) in their hub layouts: the key names
and config.json keys of radicalnumerics/RND1-Base-0910 and Salesforce/CoDA-v0-Instruct, with values that differ
from the references' defaults wherever a loader reads them (families-2.md §6.3, §7.3, §12)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from family_checkpoints import MASK_ID, VOCAB, _bias, _mlp, _norm, _rand, _write

RND1_CONFIG = dict(
    architectures=["RND1LM"], model_type="rnd1", moe_backend="hf", num_diffusion_steps=256,
    auto_map={"AutoConfig": "configuration_rnd.RND1Config", "AutoModel": "modeling_rnd.RND1Model",
              "AutoModelForMaskedLM": "modeling_rnd.RND1LM"},
    vocab_size=VOCAB, hidden_size=64, head_dim=24, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, moe_intermediate_size=24, intermediate_size=96, num_experts=8, num_experts_per_tok=3,
    norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=512,
    mask_token_id=MASK_ID, pad_token_id=99, eos_token_id=98, bos_token_id=None, tie_word_embeddings=False,
    decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", attention_bias=False, use_sliding_window=False,
    rope_scaling=False, torch_dtype="bfloat16",
)

CODA_CONFIG = dict(
    architectures=["CoDALanguageModel"], model_type="CoDA",
    auto_map={"AutoConfig": "model_config.CoDAConfig", "AutoModel": "modeling_coda.CoDALanguageModel"},
    vocab_size=VOCAB, head_dim=16, hidden_act="silu", hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_scaling=None,
    rope_theta=200000, attention_bias=True, attention_dropout=0.0, attention_kernel="flash_attention",
    mask_token_id=MASK_ID, pad_token_id=99, bos_token_id=97, eos_token_id=98, use_sliding_window=False,
    sliding_window=None, max_window_layers=2, prefix_probability=0, truncate_probability=0,
    block_masking_probability=[0.25, 0.5], mask_block_sizes=[4, 8], sampling_eps=[0.001, 0.25],
    torch_dtype="float32", transformers_version="4.47.1", use_cache=True,
)  # tie_word_embeddings absent, as in the hub file: CoDAConfig's default (true) is never acted on


def _attention(sd: dict, g: torch.Generator, p: str, d: int, h: int, kv: int, e: int, bias: bool) -> None:
    for name, rows in (("q", h * e), ("k", kv * e), ("v", kv * e)):
        sd[f"{p}self_attn.{name}_proj.weight"] = _rand(g, rows, d, scale=0.2)
        if bias:
            sd[f"{p}self_attn.{name}_proj.bias"] = _bias(g, rows)
    sd[p + "self_attn.o_proj.weight"] = _rand(g, d, h * e)
    if bias:
        sd[p + "self_attn.o_proj.bias"] = _bias(g, d)
    sd[p + "self_attn.q_norm.weight"] = _norm(g, e)
    sd[p + "self_attn.k_norm.weight"] = _norm(g, e)


def _tokens(folder: Path, names: dict[int, str]) -> None:
    added = {str(i): {"content": n, "special": True} for i, n in names.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))


def write_rnd1(folder: Path, seed: int = 0, drop: tuple[str, ...] = (), **overrides) -> tuple[Path, dict, dict]:
    """(folder, config as written, hub state dict): every layer an MoE block of per-expert modules."""
    full = {**RND1_CONFIG, **overrides}
    config = {k: v for k, v in full.items() if k not in drop}
    g = torch.Generator().manual_seed(seed)
    d, h, kv, e = (full[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    sd = {"model.embed_tokens.weight": _rand(g, VOCAB, d, scale=1.0), "model.norm.weight": _norm(g, d),
          "lm_head.weight": _rand(g, VOCAB, d, scale=0.3)}
    for i in range(full["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, d)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, d)
        _attention(sd, g, p, d, h, kv, e, bias=False)
        sd[p + "mlp.gate.weight"] = _rand(g, full["num_experts"], d, scale=0.5)
        for x in range(full["num_experts"]):
            _mlp(sd, g, f"{p}mlp.experts.{x}.", d, full["moe_intermediate_size"])
    _write(folder, config, sd)
    _tokens(folder, {MASK_ID: "<|mask|>", 98: "<|im_end|>", 99: "<|endoftext|>"})
    return folder, full, sd


def write_coda(folder: Path, seed: int = 0, **overrides) -> tuple[Path, dict, dict]:
    """(folder, config as written, hub state dict): Qwen3 names, an untied `lm_head.weight`."""
    config = {**CODA_CONFIG, **overrides}
    g = torch.Generator().manual_seed(seed)
    d, h, kv, e = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    sd = {"model.embed_tokens.weight": _rand(g, VOCAB, d, scale=1.0), "model.norm.weight": _norm(g, d),
          "lm_head.weight": _rand(g, VOCAB, d, scale=0.3)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm(g, d)
        sd[p + "post_attention_layernorm.weight"] = _norm(g, d)
        _attention(sd, g, p, d, h, kv, e, bias=config["attention_bias"])
        _mlp(sd, g, p + "mlp.", d, config["intermediate_size"])
    _write(folder, config, sd)
    (folder / "generation_config.json").write_text(json.dumps(
        {"alg": "original", "alg_temp": 0.2, "diffusion_steps": 10, "max_tokens": 256, "bos_token_id": 97,
         "eos_token_id": 98, "pad_token_id": 99}))  # CoDA-v0-Instruct's (read by no sampler code)
    (folder / "added_tokens.json").write_text(json.dumps({"<|mask|>": MASK_ID, "<|im_end|>": 98}))
    return folder, config, sd
