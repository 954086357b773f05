"""SDAR (`SDARForCausalLM`) and SDAR-MoE (`SDARMoeForCausalLM`) → HookedMDM.

SDAR is Qwen3 (SDAR-MoE: Qwen3-MoE) trained for block diffusion: q/k RMSNorm over each head before RoPE,
`q_proj/k_proj/v_proj/o_proj` (biased when `attention_bias`), and at inference a block-causal mask passed in
by the sampler (JetAstra/SDAR `generate.py`: blocks aligned at position 0, default `block_length` 4 unless
config.json names one). SDAR's attention takes that mask as is (SDPA, `is_causal=False`) and ignores the
sliding window. The MoE layers follow Qwen3-MoE: softmax router in fp32, plain top-k, renormalised only with
`norm_topk_prob`, no shared expert; layer i is MoE unless listed in `mlp_only_layers`, when
`num_experts > 0` and `(i + 1) % decoder_sparse_step == 0`. Absent keys take `SDARConfig`'s defaults
(JetAstra/SDAR `configuration_sdar.py`, e.g. head_dim 128); for SDAR-MoE, whose configuration file is not
public in that repo, transformers' `Qwen3MoeConfig` defaults (head_dim = hidden_size // heads when absent).
The mask token is `<|MASK|>`, read from the tokenizer files."""

from __future__ import annotations

import warnings

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.rope import rope_settings
from mdm_lens.loading.plan import Plan

_COMMON = {"vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
           "use_sliding_window": False}
REFERENCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sdar": {**_COMMON, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128},
    "sdar_moe": {**_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "decoder_sparse_step": 1,
                 "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
                 "mlp_only_layers": []},
}
SAMPLER_BLOCK_LENGTH = 4  # JetAstra/SDAR generate.py --block_length


def _n_experts(config: dict[str, Any], get: Any) -> int:
    """`num_experts`, or its alias `num_local_experts` (Qwen3MoeConfig.attribute_map maps one to the other, so a
    config.json naming either sets the reference's expert count); both, disagreeing, are refused."""
    if "num_local_experts" in config:
        if "num_experts" in config and config["num_experts"] != config["num_local_experts"]:
            raise ConfigError(f"config.json has num_experts={config['num_experts']} and num_local_experts="
                              f"{config['num_local_experts']} (an alias of it in Qwen3MoeConfig), which disagree.")
        return config["num_local_experts"]
    return get("num_experts")


def config_from_sdar(config: dict[str, Any], family: str, name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import dense_width, in_vocab, mask_token_id
    from mdm_lens.loading.llada2 import block_length_from

    defaults = REFERENCE_DEFAULTS[family]

    def get(key: str) -> Any:
        return config[key] if key in config else defaults[key]

    if get("hidden_act") != "silu":
        raise ConfigError(f"SDAR hidden_act={get('hidden_act')!r}; only SiLU-gated MLPs are supported.")
    if get("use_sliding_window"):  # accepted as the reference does, but said: the key promises something else
        warnings.warn(f"{folder}: SDAR config has use_sliding_window=true; the reference's attention (SDPA under the "
                      "sampler's block mask) ignores it, and so does mdm_lens: every block sees all earlier ones.",
                      UserWarning, stacklevel=4)
    d_model, n_heads = get("hidden_size"), get("num_attention_heads")
    n_layers = get("num_hidden_layers")
    n_kv = get("num_key_value_heads") or n_heads
    d_head = get("head_dim") or d_model // n_heads
    theta, scaling = rope_settings({**config, "rope_theta": get("rope_theta")}, "llama",
                                   get("max_position_embeddings"))
    moe_layers = [False] * n_layers
    extra: dict[str, Any] = {"arch": family, "qk_norm": True, "o_bias": bool(get("attention_bias")),
                             "block_length": block_length_from(config, SAMPLER_BLOCK_LENGTH)}
    if scaling:
        extra["rope_scaling"] = scaling
    if family == "sdar_moe":
        skip, step, n_experts = get("mlp_only_layers") or [], get("decoder_sparse_step"), _n_experts(config, get)
        moe_layers = [i not in skip and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        if any(moe_layers) and get("num_experts_per_tok") > n_experts:
            raise ConfigError(f"SDAR-MoE num_experts_per_tok={get('num_experts_per_tok')} exceeds num_experts="
                              f"{n_experts}.")
        if any(moe_layers):
            extra["moe"] = {"n_experts": n_experts, "top_k": get("num_experts_per_tok"), "score": "softmax",
                            "renorm": bool(get("norm_topk_prob")), "renorm_eps": 0.0, "expert_bias": None,
                            "d_expert": get("moe_intermediate_size"), "d_shared": None}
    extra["moe_layers"] = moe_layers
    cfg = MDMConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_mlp=dense_width(config, "intermediate_size", get("intermediate_size"), moe_layers, extra),
        d_vocab=get("vocab_size"), n_ctx=get("max_position_embeddings"), rope_theta=theta,
        norm_eps=float(get("rms_norm_eps")), qkv_bias=bool(get("attention_bias")), attention="block_causal",
        rope_full_precision=False, tie_word_embeddings=bool(get("tie_word_embeddings")),
        pad_token_id=in_vocab(config.get("pad_token_id"), get("vocab_size")),
        bos_token_id=in_vocab(config.get("bos_token_id"), get("vocab_size")),
        family=family, model_name=name, extra=extra,
    )
    cfg.mask_token_id = mask_token_id(config, folder, cfg.d_vocab)
    return cfg


def sdar_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.loading.family_parts import hf_layout_plan

    return hf_layout_plan(cfg, bias=None, shared=None)
