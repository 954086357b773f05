"""LLaDA (`LLaDAModelLM`, OLMo-derived names) → HookedMDM. Spec: architectures.md §2.

A key absent from `config.json` takes the default of the reference `configuration_llada.ModelConfig`
(the dataclass every `LLaDAConfig` starts from), not a guess from the released 8B checkpoint: e.g. a
missing `weight_tying` means *tied* (reference default True), a missing `rope_theta` means 10000."""

from __future__ import annotations

from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan, block_plan

# `configuration_llada.ModelConfig` defaults (the GPT-2-sized base the dataclass documents).
REFERENCE_DEFAULTS: dict[str, Any] = {
    "d_model": 768, "n_heads": 12, "n_kv_heads": None, "n_layers": 12, "mlp_ratio": 4, "mlp_hidden_size": None,
    "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1, "alibi": False, "rope": False,
    "rope_full_precision": True, "multi_query_attention": None, "attention_layer_norm": False,
    "input_emb_norm": False, "layer_norm_type": "default", "layer_norm_with_affine": True, "rms_norm_eps": 1e-5,
    "max_sequence_length": 1024, "rope_theta": 10000.0, "include_qkv_bias": False, "include_bias": False,
    "bias_for_layer_norm": None, "scale_logits": False, "vocab_size": 50257, "embedding_size": 50304,
    "weight_tying": True,
}
# generate.py's `mask_id=126336` is what the sampler uses whatever the config says, so it is our
# default when config.json has no mask_token_id (ModelConfig's own 50256 is GPT-2's EOS, never used).
SAMPLER_MASK_ID = 126336


ARCHITECTURE, MODEL_TYPE = "LLaDAModelLM", "llada"  # read by loading/dispatch.py's list of supported names


def is_llada(config: dict[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE or ARCHITECTURE in (config.get("architectures") or [])


def _get(config: dict[str, Any], key: str) -> Any:
    return config[key] if key in config else REFERENCE_DEFAULTS[key]


def _require(config: dict[str, Any], key: str, ok: Any, why: str = "") -> None:
    value = _get(config, key)
    if value != ok:
        origin = "" if key in config else f" (absent from config.json: the reference default is {value!r})"
        raise ConfigError(f"LLaDA config has {key}={value!r}{origin}; mdm_lens implements {key}={ok!r} only"
                          f"{why}. This variant is not supported.")


def effective_n_kv_heads(config: dict[str, Any]) -> int:
    """The reference's `ModelConfig.effective_n_kv_heads`: `multi_query_attention` and `n_kv_heads` must agree."""
    n_heads, n_kv, mqa = _get(config, "n_heads"), _get(config, "n_kv_heads"), _get(config, "multi_query_attention")
    if n_kv is None:
        return 1 if mqa is True else n_heads
    if mqa is None:
        return n_kv
    should_be = 1 if mqa else n_heads
    if n_kv != should_be:
        raise ConfigError(f"LLaDA config sets multi_query_attention={mqa!r} and n_kv_heads={n_kv}, which disagree "
                          f"(multi_query_attention={mqa!r} means n_kv_heads={should_be}); the reference raises here "
                          "too. Set one of them to null.")
    return should_be


def config_from_llada(config: dict[str, Any], name: str) -> MDMConfig:
    for key, ok in (("attention_layer_norm", False), ("alibi", False), ("scale_logits", False),
                    ("input_emb_norm", False), ("include_bias", False), ("block_group_size", 1),
                    ("layer_norm_with_affine", True), ("rope", True), ("layer_norm_type", "rms"),
                    ("activation_type", "silu"), ("block_type", "llama")):
        _require(config, key, ok)
    if _get(config, "bias_for_layer_norm"):
        raise ConfigError("LLaDA config has bias_for_layer_norm=true (RMSNorm with a bias); not supported.")
    n_heads, d_model = _get(config, "n_heads"), _get(config, "d_model")
    if d_model % n_heads:  # the reference asserts this: its head size is d_model // n_heads, no head_dim key
        raise ConfigError(f"LLaDA d_model={d_model} is not divisible by n_heads={n_heads}.")
    vocab = _get(config, "vocab_size")
    embedding = _get(config, "embedding_size") or vocab  # explicit null means "same as vocab_size"
    if embedding < vocab:
        raise ConfigError(f"LLaDA embedding_size={embedding} is smaller than vocab_size={vocab}; the reference "
                          "refuses this too.")
    d_mlp = _get(config, "mlp_hidden_size") or _get(config, "mlp_ratio") * d_model
    extra = {"vocab_size": vocab}  # the tokenizer's size; logits are embedding_size wide, as in the reference
    return MDMConfig(
        d_model=d_model, n_layers=_get(config, "n_layers"), n_heads=n_heads, n_kv_heads=effective_n_kv_heads(config),
        d_head=d_model // n_heads, d_mlp=d_mlp, d_vocab=embedding, n_ctx=_get(config, "max_sequence_length"),
        rope_theta=float(_get(config, "rope_theta")), norm_eps=float(_get(config, "rms_norm_eps")),
        qkv_bias=bool(_get(config, "include_qkv_bias")), attention="bidirectional", logit_shift=False,
        rope_full_precision=bool(_get(config, "rope_full_precision")), position_policy="arange",
        padding_mask="key", tie_word_embeddings=bool(_get(config, "weight_tying")),
        # absent: SAMPLER_MASK_ID via the family defaults, which skip an id this vocabulary cannot hold
        mask_token_id=config.get("mask_token_id"), eos_token_id=None,
        pad_token_id=config.get("pad_token_id"), bos_token_id=config.get("bos_token_id"),
        family="llada", model_name=name, extra=extra,
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
