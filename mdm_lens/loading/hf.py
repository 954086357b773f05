"""Llama, Qwen2 and Dream (which is the Qwen2 module tree) → HookedMDM. Spec: architectures.md §4, §11."""

from __future__ import annotations

from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan, block_plan

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "DreamModel": "dream"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "dream": "dream"}


def hf_family(config: dict[str, Any]) -> str | None:
    for arch in config.get("architectures") or []:
        if arch in FAMILIES:
            return FAMILIES[arch]
    return MODEL_TYPES.get(str(config.get("model_type", "")).lower())


def _rope_theta(config: dict[str, Any], default: float) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"rope type {kind!r} (rope scaling) is not implemented; only plain rotary embeddings "
                          "(Llama-3-8B, Qwen2.5-7B, Dream-v0) are supported.")
    return float(params.get("rope_theta", config.get("rope_theta", default)))


def config_from_hf(config: dict[str, Any], family: str, name: str) -> MDMConfig:
    if config.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported (no released Llama/Qwen2/Dream checkpoint uses it).")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={config['hidden_act']!r}; only SiLU-gated MLPs are supported.")
    if family == "qwen2" and config.get("use_sliding_window"):
        raise ConfigError("Qwen2 sliding-window attention is not implemented; set use_sliding_window=false.")
    n_heads = config["num_attention_heads"]
    d_model = config["hidden_size"]
    dream = family == "dream"
    qkv_bias = True if family in ("qwen2", "dream") else bool(config.get("attention_bias", False))
    default_theta = 1e6 if family in ("qwen2", "dream") else 10000.0
    return MDMConfig(
        d_model=d_model, n_layers=config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads, d_head=config.get("head_dim") or d_model // n_heads,
        d_mlp=config["intermediate_size"], d_vocab=config["vocab_size"],
        n_ctx=config.get("max_position_embeddings", 4096), rope_theta=_rope_theta(config, default_theta),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), qkv_bias=qkv_bias,
        attention="bidirectional" if dream else "causal", logit_shift=dream, rope_full_precision=False,
        position_policy="cumsum" if dream else "arange", padding_mask="pair" if dream else "key",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        mask_token_id=config.get("mask_token_id") if dream else None, bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id") if not isinstance(config.get("eos_token_id"), list)
        else config["eos_token_id"][0],
        pad_token_id=config.get("pad_token_id"), family=family, model_name=name,
    )


def hf_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    prefix = "model." if any(k.startswith("model.layers.") for k in keys) else ""
    plan: Plan = {"embed.W_E": [prefix + "embed_tokens.weight"], "ln_final.w": [prefix + "norm.weight"]}
    if not cfg.tie_word_embeddings:
        plan["unembed.weight"] = ["lm_head.weight"]
    for i in range(cfg.n_layers):
        b = f"{prefix}layers.{i}."
        names = {"ln1": b + "input_layernorm.weight", "q": b + "self_attn.q_proj.weight",
                 "k": b + "self_attn.k_proj.weight", "v": b + "self_attn.v_proj.weight",
                 "o": b + "self_attn.o_proj.weight", "ln2": b + "post_attention_layernorm.weight",
                 "gate": b + "mlp.gate_proj.weight", "up": b + "mlp.up_proj.weight", "down": b + "mlp.down_proj.weight",
                 "q_bias": b + "self_attn.q_proj.bias", "k_bias": b + "self_attn.k_proj.bias",
                 "v_bias": b + "self_attn.v_proj.bias"}
        plan.update(block_plan(cfg, i, names, cfg.qkv_bias))
    return plan
