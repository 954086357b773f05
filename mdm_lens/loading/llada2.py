"""LLaDA2.x (`LLaDA2MoeModelLM`, `model_type: llada2_moe`) → HookedMDM.

Facts from the reference `modeling_llada2_moe.py` / `configuration_llada2_moe.py` (dllm ca176752): fused
`attention.query_key_value` ([q heads | k heads | v heads] rows), per-head RMSNorm on q and k before RoPE
(`query_layernorm`/`key_layernorm`, when `use_qk_norm`), partial rotary on the first
`int(head_dim * partial_rotary_factor)` dims, `attention.dense` with a bias when `use_bias`, dense MLPs for
layers `< first_k_dense_replace`, then the sigmoid group-limited MoE of `mdm_lens.moe` with
`num_shared_experts` shared experts (one MLP of width `moe_intermediate_size * num_shared_experts`).
A key absent from config.json takes `LLaDA2MoeConfig`'s default (below). The sampler always runs a
block-causal mask; its default block length is the dllm `LLaDA2SamplerConfig.block_size` (32) unless
config.json names one (`block_length` / `block_size`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan

REFERENCE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30592, "hidden_size": 1024, "intermediate_size": None, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 0, "hidden_act": "silu", "use_qkv_bias": False,
    "use_qk_norm": True, "use_bias": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "max_position_embeddings": 16384, "rope_theta": 10000.0, "use_sliding_window": False, "rope_scaling": None,
    "pad_token_id": 126081, "num_experts": 16, "num_shared_experts": 0, "num_experts_per_tok": 2, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "moe_intermediate_size": None, "first_k_dense_replace": 0,
    "head_dim": None, "partial_rotary_factor": 0.5,
}
SAMPLER_BLOCK_LENGTH = 32  # dllm LLaDA2SamplerConfig.block_size


def is_llada2(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "llada2_moe" or "LLaDA2MoeModelLM" in (config.get("architectures") or [])


def _get(config: dict[str, Any], key: str) -> Any:
    return config[key] if key in config else REFERENCE_DEFAULTS[key]


def _positive(config: dict[str, Any], key: str, getter: Any = _get) -> int:
    value = getter(config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        origin = "" if key in config else " (absent from config.json: the reference default)"
        raise ConfigError(f"config.json has {key}={value!r}{origin}; a positive int is needed.")
    return value


def block_length_from(config: dict[str, Any], default: int) -> int:
    """config.json's `block_length` (or `block_size`), else the sampler's default. The values were range-checked
    (loading/values.py: a 0, -4 or "8" is a ConfigError, never replaced by the default); two that disagree are
    refused rather than one picked."""
    given = {key: config[key] for key in ("block_length", "block_size") if key in config}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config.json has {key}={value!r}: expected an int > 0 (the sampler's block length).")
    if len(set(given.values())) > 1:
        raise ConfigError(f"config.json has block_length={given['block_length']!r} and block_size="
                          f"{given['block_size']!r}, which disagree; keep one of them.")
    return next(iter(given.values()), default)


def _check_routing(config: dict[str, Any]) -> None:
    """The group-limited top-k the reference runs must be possible: experts split evenly into `n_group` groups,
    `topk_group <= n_group`, and enough experts in the chosen groups for `num_experts_per_tok`."""
    n, groups, chosen, k = (_positive(config, key) for key in ("num_experts", "n_group", "topk_group",
                                                                "num_experts_per_tok"))
    if n % groups:
        raise ConfigError(f"LLaDA2 num_experts={n} is not divisible by n_group={groups} (experts are split into "
                          "equal groups).")
    if chosen > groups:
        raise ConfigError(f"LLaDA2 topk_group={chosen} exceeds n_group={groups}.")
    if k > chosen * (n // groups):
        raise ConfigError(f"LLaDA2 num_experts_per_tok={k} exceeds the {chosen * (n // groups)} experts of the "
                          f"topk_group={chosen} chosen groups (num_experts={n}, n_group={groups}).")


# keys the reference's LLaDA2MoeGate never reads: it scores with sigmoid and always holds an `expert_bias` buffer
# (added to the selection scores). Their values are checked, and one that says otherwise is warned about, never
# silently honoured or silently ignored.
IGNORED_ROUTER_KEYS: dict[str, tuple[tuple[Any, ...], Any]] = {
    "score_function": (("sigmoid", "softmax"), "sigmoid"),
    "moe_router_enable_expert_bias": ((True, False), True),
}


def _check_ignored_router_keys(config: dict[str, Any], folder: Path) -> None:
    import warnings

    from mdm_lens.loading.rnd1 import ReferenceConfigWarning

    for key, (allowed, used) in IGNORED_ROUTER_KEYS.items():
        if key not in config:
            continue
        value = config[key]
        if not any(value is a if isinstance(a, bool) else (type(value) is str and value == a) for a in allowed):
            raise ConfigError(f"{folder / 'config.json'}: LLaDA2 {key}={value!r} is invalid: expected one of "
                              f"{list(allowed)} (the reference's gate ignores the key and runs {key}={used!r}).")
        if value != used:
            warnings.warn(f"{folder / 'config.json'}: LLaDA2 {key}={value!r}, which the reference's router "
                          f"(LLaDA2MoeGate) ignores: it runs {key}={used!r} (sigmoid scores, the expert_bias "
                          "buffer added for selection); so does mdm_lens.", ReferenceConfigWarning, stacklevel=4)


def config_from_llada2(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import dense_width, in_vocab, mask_token_id
    from mdm_lens.loading.llada22 import apply_edit_tokens, check_llada22

    check_llada22(config, name)  # LLaDA2.2's block routing: refused, its config facts are unknown
    if _get(config, "hidden_act") != "silu":
        raise ConfigError(f"LLaDA2 hidden_act={_get(config, 'hidden_act')!r}; only SiLU-gated MLPs are supported.")
    if _get(config, "rope_scaling"):
        raise ConfigError(f"LLaDA2 rope_scaling={_get(config, 'rope_scaling')} is not implemented (plain RoPE only).")
    if _get(config, "use_sliding_window"):
        raise ConfigError("LLaDA2 use_sliding_window=true is not implemented.")
    _check_ignored_router_keys(config, folder)
    d_model, n_heads = _positive(config, "hidden_size"), _positive(config, "num_attention_heads")
    n_kv = _positive(config, "num_key_value_heads")
    d_head = _get(config, "head_dim") or d_model // n_heads
    n_layers = _positive(config, "num_hidden_layers")
    n_experts = _get(config, "num_experts")
    moe_layers = [n_experts is not None and i >= _get(config, "first_k_dense_replace") for i in range(n_layers)]
    extra: dict[str, Any] = {
        "arch": "llada2_moe", "qk_norm": bool(_get(config, "use_qk_norm")), "o_bias": bool(_get(config, "use_bias")),
        "rotary_dim": int(d_head * _get(config, "partial_rotary_factor")), "moe_layers": moe_layers,
        "block_length": block_length_from(config, SAMPLER_BLOCK_LENGTH),
    }
    if any(moe_layers):
        n_shared = _get(config, "num_shared_experts") or 0
        d_expert = _positive(config, "moe_intermediate_size")
        _check_routing(config)
        extra["moe"] = {
            "n_experts": n_experts, "top_k": _positive(config, "num_experts_per_tok"), "score": "sigmoid",
            "n_group": _positive(config, "n_group"), "topk_group": _positive(config, "topk_group"),
            "scaling": float(_get(config, "routed_scaling_factor")), "renorm": True, "renorm_eps": 1e-20,
            "expert_bias": "selection", "d_expert": d_expert, "d_shared": d_expert * n_shared or None,
        }
    d_mlp = dense_width(config, "intermediate_size", _get(config, "intermediate_size"), moe_layers, extra)
    cfg = MDMConfig(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_mlp=d_mlp, d_vocab=_positive(config, "vocab_size"),
        n_ctx=_get(config, "max_position_embeddings"), rope_theta=float(_get(config, "rope_theta")),
        norm_eps=float(_get(config, "rms_norm_eps")), qkv_bias=bool(_get(config, "use_qkv_bias")),
        attention="block_causal", rope_full_precision=False, tie_word_embeddings=bool(_get(config, "tie_word_embeddings")),
        pad_token_id=in_vocab(_get(config, "pad_token_id"), _positive(config, "vocab_size")),
        bos_token_id=in_vocab(config.get("bos_token_id"), _positive(config, "vocab_size")),
        family="llada2_moe", model_name=name, extra=extra,
    )
    cfg.mask_token_id = mask_token_id(config, folder, cfg.d_vocab)
    apply_edit_tokens(cfg, config)  # LLaDA2.2's InDel edit tokens, when config.json names them
    return cfg


def llada2_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.loading.family_parts import moe_plan, mlp_plan

    plan: Plan = {"embed.W_E": ["model.word_embeddings.weight"], "ln_final.w": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        plan["unembed.weight"] = ["lm_head.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        plan.update({dst + "ln1.w": [src + "input_layernorm.weight"],
                     dst + "ln2.w": [src + "post_attention_layernorm.weight"],
                     dst + "attn.qkv_weight": [src + "attention.query_key_value.weight"],
                     dst + "attn.o_weight": [src + "attention.dense.weight"]})
        if cfg.qkv_bias:
            plan[dst + "attn.qkv_bias"] = [src + "attention.query_key_value.bias"]
        if cfg.extra["o_bias"]:
            plan[dst + "attn.o_bias"] = [src + "attention.dense.bias"]
        if cfg.extra["qk_norm"]:
            plan[dst + "attn.q_norm.w"] = [src + "attention.query_layernorm.weight"]
            plan[dst + "attn.k_norm.w"] = [src + "attention.key_layernorm.weight"]
        if cfg.extra["moe_layers"][i]:
            plan.update(moe_plan(cfg, dst + "mlp.", src + "mlp.", router=src + "mlp.gate.weight",
                                 bias=src + "mlp.gate.expert_bias", shared=src + "mlp.shared_experts."))
        else:
            plan.update(mlp_plan(dst + "mlp.", src + "mlp."))
    return plan
