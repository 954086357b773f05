"""LLaDA (`LLaDAModelLM`, OLMo-derived names) → HookedMDM. Spec: architectures.md §2."""

from __future__ import annotations

from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan, block_plan


def is_llada(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "llada" or "LLaDAModelLM" in config.get("architectures", [])


def _reject(config: dict[str, Any], key: str, ok: Any) -> None:
    value = config.get(key)
    if value not in (None, ok):
        raise ConfigError(f"LLaDA config has {key}={value!r}; mdm_lens implements the released LLaDA-8B "
                          f"architecture ({key}={ok!r}). This variant is not supported yet.")


def config_from_llada(config: dict[str, Any], name: str) -> MDMConfig:
    for key, ok in (("attention_layer_norm", False), ("alibi", False), ("scale_logits", False),
                    ("input_emb_norm", False), ("include_bias", False)):
        _reject(config, key, ok)
    if config.get("rope") is False:
        raise ConfigError("LLaDA config has rope=false; only rotary LLaDA checkpoints are supported.")
    if config.get("layer_norm_type", "rms") != "rms":
        raise ConfigError(f"LLaDA layer_norm_type={config['layer_norm_type']!r}; only 'rms' is supported.")
    if config.get("activation_type", "silu") != "silu" or config.get("block_type", "llama") != "llama":
        raise ConfigError("only LLaDA 'llama' blocks with SiLU gating are supported.")
    n_heads = config["n_heads"]
    n_kv = config.get("n_kv_heads")
    if n_kv is None:
        n_kv = 1 if config.get("multi_query_attention") else n_heads
    d_model = config["d_model"]
    d_mlp = config.get("mlp_hidden_size") or config.get("mlp_ratio", 4) * d_model
    vocab = config.get("embedding_size") or config["vocab_size"]
    return MDMConfig(
        d_model=d_model, n_layers=config["n_layers"], n_heads=n_heads, n_kv_heads=n_kv, d_mlp=d_mlp, d_vocab=vocab,
        n_ctx=config.get("max_sequence_length", 4096), rope_theta=float(config.get("rope_theta", 10000.0)),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)), qkv_bias=bool(config.get("include_qkv_bias", False)),
        attention="bidirectional", logit_shift=False, rope_full_precision=bool(config.get("rope_full_precision", True)),
        position_policy="arange", padding_mask="key", tie_word_embeddings=bool(config.get("weight_tying", False)),
        mask_token_id=config.get("mask_token_id", 126336), eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"), bos_token_id=config.get("bos_token_id"),
        family="llada", model_name=name,
    )


def llada_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    prefix = "model.transformer." if any(k.startswith("model.transformer.") for k in keys) else "transformer."
    plan: Plan = {"embed.W_E": [prefix + "wte.weight"], "ln_final.w": [prefix + "ln_f.weight"]}
    if not cfg.tie_word_embeddings:
        plan["unembed.weight"] = [prefix + "ff_out.weight"]
    for i in range(cfg.n_layers):
        b = f"{prefix}blocks.{i}."
        names = {"ln1": b + "attn_norm.weight", "q": b + "q_proj.weight", "k": b + "k_proj.weight",
                 "v": b + "v_proj.weight", "o": b + "attn_out.weight", "ln2": b + "ff_norm.weight",
                 # the trap of this family: ff_proj is the SiLU *gate*, up_proj the linear branch
                 "gate": b + "ff_proj.weight", "up": b + "up_proj.weight", "down": b + "ff_out.weight",
                 "q_bias": b + "q_proj.bias", "k_bias": b + "k_proj.bias", "v_bias": b + "v_proj.bias"}
        plan.update(block_plan(cfg, i, names, cfg.qkv_bias))
    return plan
