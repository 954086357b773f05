"""RND1 (`RND1LM`, model_type `rnd1`; Radical Numerics, Qwen3-30B-A3B made bidirectional) → HookedMDM.

Facts from RadicalNumerics/RND1 @ 87d5f465 (`rnd/configuration_rnd.py`, `rnd/modeling_rnd.py`), spec
families-2.md §6: Qwen3-MoE layers (q/k RMSNorm over each head before RoPE, no attention biases) with full
bidirectional attention; *every* layer is a softmax-routed MoE (no dense layer, no shared expert), top-k renormalised
with `norm_topk_prob`, and the routing weights stay fp32 up to the product with each expert's output (Qwen3-MoE casts
them to the activation dtype first: bf16 runs differ). The logits are shifted (position i predicts token i+1).

Trap: `RND1Config.__init__` calls `set_config_defaults()`, which overwrites every architecture key with the 30B
values, so the reference silently ignores a config.json that says otherwise. mdm_lens reads the checkpoint's own
config.json (the weights must match it) and warns with `ReferenceConfigWarning`, naming each key where config.json and
the reference's forced value disagree: the reference would build a different model from the same folder. Keys absent
from config.json take the forced values."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan

# RND1Config.set_config_defaults (CONFIG_DEFAULTS), the values the reference forces whatever config.json says
FORCED: dict[str, Any] = {
    "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "pad_token_id": 151643, "rms_norm_eps": 1e-6, "rope_scaling": False,
    "rope_theta": 1e6, "sliding_window": False, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
MASK_TOKEN_ID = 151669  # RND1Config(mask_token_id=151669): a constructor argument, so config.json's value is kept


class ReferenceConfigWarning(UserWarning):
    """config.json says something the family's reference code ignores (it builds the model from other values)."""


def forced_disagreements(config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`{key: (config.json value, forced value)}` for every forced key config.json sets to something else."""
    return {k: (config[k], v) for k, v in FORCED.items() if k in config and config[k] != v
            and not (isinstance(v, float) and isinstance(config[k], (int, float)) and float(config[k]) == v)}


def _warn_forced(config: dict[str, Any], folder: Path) -> None:
    diff = forced_disagreements(config)
    if diff:
        shown = ", ".join(f"{k}={a!r} (reference: {b!r})" for k, (a, b) in diff.items())
        warnings.warn(f"{folder / 'config.json'}: RND1's reference config class overwrites these keys with its 30B "
                      f"defaults, so remote code would build a different model from this folder; mdm_lens follows "
                      f"config.json (the weights match it): {shown}.", ReferenceConfigWarning, stacklevel=4)


def config_from_rnd1(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import in_vocab, mask_token_id

    def get(key: str) -> Any:
        return config[key] if key in config else FORCED[key]

    _warn_forced(config, folder)
    if get("hidden_act") != "silu":
        raise ConfigError(f"RND1 hidden_act={get('hidden_act')!r}; only SiLU-gated experts are supported.")
    for key in ("rope_scaling", "use_sliding_window", "attention_bias"):
        if get(key):
            raise ConfigError(f"RND1 {key}={get(key)!r}: the reference hard-codes it off (plain RoPE, full attention, "
                              "no biases); mdm_lens refuses a checkpoint that needs it.")
    n_layers, n_experts, top_k = get("num_hidden_layers"), get("num_experts"), get("num_experts_per_tok")
    if top_k > n_experts:
        raise ConfigError(f"RND1 num_experts_per_tok={top_k} exceeds num_experts={n_experts}.")
    d_expert = get("moe_intermediate_size")
    extra: dict[str, Any] = {
        "arch": "rnd1", "qk_norm": True, "o_bias": False, "moe_layers": [True] * n_layers,
        # RND1SparseMoeBlock (hf backend): softmax in fp32, top-k, renormalised; the weights stay fp32
        "moe": {"n_experts": n_experts, "top_k": top_k, "score": "softmax", "renorm": bool(get("norm_topk_prob")),
                "renorm_eps": 0.0, "expert_bias": None, "d_expert": d_expert, "d_shared": None,
                "fp32_weights": True},
    }
    d_vocab = get("vocab_size")
    mask = mask_token_id(config, folder, d_vocab)  # config.json, else the tokenizer files
    if mask is None and MASK_TOKEN_ID < d_vocab:
        mask = MASK_TOKEN_ID  # the constructor default, only where this vocabulary has that row
    return MDMConfig(
        d_model=get("hidden_size"), n_layers=n_layers, n_heads=get("num_attention_heads"),
        n_kv_heads=get("num_key_value_heads"), d_head=get("head_dim"), d_mlp=d_expert, d_vocab=d_vocab,
        n_ctx=get("max_position_embeddings"), rope_theta=float(get("rope_theta")), norm_eps=float(get("rms_norm_eps")),
        qkv_bias=False, attention="bidirectional", logit_shift=True, rope_full_precision=False,
        position_policy="arange", padding_mask="key", tie_word_embeddings=bool(get("tie_word_embeddings")),
        mask_token_id=mask, pad_token_id=in_vocab(get("pad_token_id"), d_vocab),
        bos_token_id=in_vocab(config.get("bos_token_id"), d_vocab), eos_token_id=in_vocab(get("eos_token_id"), d_vocab),
        family="rnd1", model_name=name, extra=extra,
    )


def rnd1_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.loading.family_parts import hf_layout_plan

    return hf_layout_plan(cfg, bias=None, shared=None)
