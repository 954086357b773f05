"""Llama, Qwen2 and Dream (which is the Qwen2 module tree) → HookedMDM. Spec: architectures.md §4, §11.

A key absent from `config.json` takes the default of that family's reference config class (`LlamaConfig`,
`Qwen2Config` in transformers, `DreamConfig` in Dream's `configuration_dream.py`), and options the
reference model ignores are ignored here too (Dream hard-codes q/k/v biases and `head_dim =
hidden_size // num_attention_heads`, whatever the config says)."""

from __future__ import annotations

import warnings
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan, block_plan
from mdm_lens.loading.rope import rope_settings  # re-exported: older code imports it from here

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "DreamModel": "dream"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "dream": "dream"}

_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
           "rope_scaling": None, "head_dim": None}
REFERENCE_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' LlamaConfig (num_key_value_heads None -> num_attention_heads)
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    # transformers' Qwen2Config (q/k/v biases are hard-coded in Qwen2Attention)
    "qwen2": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False},
    # Dream's DreamConfig (configuration_dream.py): note rope_theta 10000 and 32 kv heads when absent
    "dream": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False, "mask_token_id": 151666,
              "pad_token_id": 151643},
}


def hf_family(config: dict[str, Any]) -> str | None:
    for arch in config.get("architectures") or []:
        if arch in FAMILIES:
            return FAMILIES[arch]
    return MODEL_TYPES.get(str(config.get("model_type", "")).lower())


def _get(config: dict[str, Any], family: str, key: str) -> Any:
    return config[key] if key in config else REFERENCE_DEFAULTS[family].get(key)


def _n_kv_heads(config: dict[str, Any], family: str, n_heads: int) -> int:
    if "num_key_value_heads" in config and config["num_key_value_heads"] is None:
        return n_heads  # explicit null: every reference maps it to multi-head attention
    n_kv = _get(config, family, "num_key_value_heads")
    n_kv = n_heads if n_kv is None else n_kv
    if n_heads % n_kv:
        origin = "" if "num_key_value_heads" in config else " (absent from config.json: the reference default)"
        raise ConfigError(f"num_key_value_heads={n_kv}{origin} does not divide num_attention_heads={n_heads}.")
    return n_kv


def _head_dim(config: dict[str, Any], family: str, d_model: int, n_heads: int) -> int:
    derived = d_model // n_heads
    given = config.get("head_dim")
    if family == "dream":  # DreamAttention: head_dim = hidden_size // num_heads, and it raises if inexact
        if derived * n_heads != d_model:
            raise ConfigError(f"Dream needs hidden_size={d_model} divisible by num_attention_heads={n_heads}.")
        if given not in (None, derived):
            warnings.warn(f"Dream config has head_dim={given}, which the reference ignores (it uses hidden_size // "
                          f"num_attention_heads = {derived}); so does mdm_lens.", stacklevel=3)
        return derived
    return given or derived  # LlamaAttention / Qwen2Attention: `head_dim` when set, else hidden // heads


def _check_options(config: dict[str, Any], family: str) -> None:
    act = _get(config, family, "hidden_act")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}; only SiLU-gated MLPs are supported.")
    if family == "llama":
        for key, what in (("mlp_bias", "gate/up/down"), ("attention_bias", "q/k/v *and* o_proj")):
            if _get(config, family, key):
                raise ConfigError(f"Llama {key}=true puts biases on {what}; mdm_lens has q/k/v biases only, so it "
                                  "refuses this checkpoint rather than drop a bias.")
    if _get(config, family, "use_sliding_window"):
        if family == "qwen2":
            raise ConfigError("Qwen2 sliding-window attention is not implemented; set use_sliding_window=false.")
        # Dream always runs DreamSdpaAttention, which ignores the window (the reference only warns)
        warnings.warn("Dream config has use_sliding_window=true; the reference's SDPA attention ignores it, and so "
                      "does mdm_lens (full attention).", stacklevel=3)


def _eos(value: Any) -> int | None:
    return value[0] if isinstance(value, list) and value else (value if isinstance(value, int) else None)


def config_from_hf(config: dict[str, Any], family: str, name: str) -> MDMConfig:
    _check_options(config, family)
    n_heads, d_model = _get(config, family, "num_attention_heads"), _get(config, family, "hidden_size")
    dream = family == "dream"
    # Qwen2Attention and DreamAttention hard-code q/k/v biases; Llama follows attention_bias (checked above)
    qkv_bias = family in ("qwen2", "dream")
    theta, scaling = rope_settings(config, family, _get(config, family, "max_position_embeddings"))
    extra: dict[str, Any] = {"rope_scaling": scaling} if scaling else {}
    return MDMConfig(
        d_model=d_model, n_layers=_get(config, family, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=_n_kv_heads(config, family, n_heads), d_head=_head_dim(config, family, d_model, n_heads),
        d_mlp=_get(config, family, "intermediate_size"), d_vocab=_get(config, family, "vocab_size"),
        n_ctx=_get(config, family, "max_position_embeddings"), rope_theta=theta,
        norm_eps=float(_get(config, family, "rms_norm_eps")), qkv_bias=qkv_bias,
        attention="bidirectional" if dream else "causal", logit_shift=dream, rope_full_precision=False,
        position_policy="cumsum" if dream else "arange", padding_mask="pair" if dream else "key",
        tie_word_embeddings=bool(_get(config, family, "tie_word_embeddings")),
        # absent ids: the family defaults fill them later, only when this vocabulary can hold them
        mask_token_id=config.get("mask_token_id") if dream else None,
        bos_token_id=_eos(config.get("bos_token_id")), eos_token_id=None,
        pad_token_id=_eos(config.get("pad_token_id")), family=family, model_name=name, extra=extra,
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
