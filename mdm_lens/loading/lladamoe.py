"""LLaDA-MoE (`LLaDAMoEModelLM`; its `model_type` is `llada`, like LLaDA-8B's) → HookedMDM.

Facts from the reference `modeling_lladamoe.py` / `configuration_lladamoe.py` (dllm ca176752): full
bidirectional attention; `q_proj/k_proj/v_proj/o_proj` (all biased when `attention_bias`); with
`qk_layernorm`, an RMSNorm over each head of q and k, then `clip_qkv` clamps q, k and v, then partial rotary
on the first `int(head_dim * partial_rotary_factor)` dims (head_dim = hidden_size // num_attention_heads,
whatever `head_dim` says). Layer i is MoE when `moe_layer_freq[i] != 0`, else a dense MLP of width
`dense_intermediate_size`; MoE layers route with a softmax and plain top-k, the top-k weights are *not*
renormalised (`norm_topk_prob` is hard-coded off), and with `moe_router_enable_expert_bias` the bias is added
to the probabilities, so it changes the weights as well as the choice (reproduced as is). MoE layers also
run `shared_expert` (a layer-level MLP of width `shared_expert_intermediate_size`) when that key is not null.
`routed_scaling_factor`, `router_num_group` and `moe_router_score_function` are read by no reference code.
Absent keys take `LLaDAMoEConfig`'s defaults, many of which are the invalid sentinel -1 (refused by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan

REFERENCE_DEFAULTS: dict[str, Any] = {
    "vocab_size": -1, "hidden_size": -1, "dense_intermediate_size": -1, "expert_intermediate_size": -1,
    "shared_expert_intermediate_size": -1, "num_hidden_layers": -1, "num_attention_heads": -1,
    "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279, "tie_word_embeddings": False, "rope_theta": -1,
    "partial_rotary_factor": -1, "rope_scaling": None, "attention_bias": False, "clip_qkv": None,
    "num_experts_per_tok": -1, "num_experts": -1, "qk_layernorm": None, "moe_layer_freq": [],
    "moe_router_enable_expert_bias": None,
}


def _get(config: dict[str, Any], key: str) -> Any:
    return config[key] if key in config else REFERENCE_DEFAULTS[key]


def _positive(config: dict[str, Any], key: str) -> Any:
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        origin = "" if key in config else " (absent from config.json: the reference default)"
        raise ConfigError(f"LLaDA-MoE config has {key}={value!r}{origin}; a positive number is needed.")
    return value


def config_from_lladamoe(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import dense_width, in_vocab, mask_token_id

    if _get(config, "hidden_act") != "silu":
        raise ConfigError(f"LLaDA-MoE hidden_act={_get(config, 'hidden_act')!r}; only SiLU-gated MLPs are supported.")
    if _get(config, "rope_scaling"):
        raise ConfigError(f"LLaDA-MoE rope_scaling={_get(config, 'rope_scaling')} is not implemented (plain RoPE only).")
    d_model, n_heads = int(_positive(config, "hidden_size")), int(_positive(config, "num_attention_heads"))
    if d_model % n_heads:
        raise ConfigError(f"LLaDA-MoE hidden_size={d_model} is not divisible by num_attention_heads={n_heads} "
                          "(the reference raises too).")
    n_layers = int(_positive(config, "num_hidden_layers"))
    freq = _get(config, "moe_layer_freq")
    if not isinstance(freq, list) or len(freq) < n_layers:
        raise ConfigError(f"LLaDA-MoE moe_layer_freq={freq!r} must list one entry per layer ({n_layers}).")
    moe_layers = [bool(f) for f in freq[:n_layers]]
    d_head = d_model // n_heads
    clip = _get(config, "clip_qkv")
    extra: dict[str, Any] = {
        "arch": "lladamoe", "qk_norm": bool(_get(config, "qk_layernorm")), "o_bias": bool(_get(config, "attention_bias")),
        "rotary_dim": int(d_head * _positive(config, "partial_rotary_factor")), "moe_layers": moe_layers,
        "clip_qkv": float(clip) if clip is not None else None,
    }
    if any(moe_layers):
        shared = _get(config, "shared_expert_intermediate_size")
        if shared is not None:
            shared = int(_positive(config, "shared_expert_intermediate_size"))
        extra["moe"] = {
            "n_experts": int(_positive(config, "num_experts")), "top_k": int(_positive(config, "num_experts_per_tok")),
            "score": "softmax", "renorm": False,
            "expert_bias": "weights" if _get(config, "moe_router_enable_expert_bias") else None,
            "d_expert": int(_positive(config, "expert_intermediate_size")), "d_shared": shared,
        }
    n_kv = _get(config, "num_key_value_heads") or n_heads
    d_vocab = int(_positive(config, "vocab_size"))
    cfg = MDMConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_mlp=dense_width(config, "dense_intermediate_size", _get(config, "dense_intermediate_size"), moe_layers, extra),
        d_vocab=d_vocab, n_ctx=_get(config, "max_position_embeddings"),
        rope_theta=float(_positive(config, "rope_theta")), norm_eps=float(_get(config, "rms_norm_eps")),
        qkv_bias=bool(_get(config, "attention_bias")), attention="bidirectional", rope_full_precision=False,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings")), pad_token_id=in_vocab(_get(config, "pad_token_id"), d_vocab),
        bos_token_id=in_vocab(_get(config, "bos_token_id"), d_vocab), family="lladamoe", model_name=name, extra=extra,
    )
    cfg.mask_token_id = mask_token_id(config, folder, cfg.d_vocab)
    return cfg


def lladamoe_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.loading.family_parts import hf_layout_plan

    # the shared expert hangs off the decoder layer, not the MoE block, in this checkpoint layout
    return hf_layout_plan(cfg, bias="mlp.expert_bias", shared="shared_expert.")
