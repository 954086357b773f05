"""CoDA (`CoDALanguageModel`, model_type `CoDA`; Salesforce, Qwen3-1.7B made bidirectional) → HookedMDM.

Facts from SalesforceAIResearch/CoDA @ fa1d5050 (`CoDALanguageModel/{model_config,modeling_coda,attention}.py`), spec
families-2.md §7: Qwen3 layers (q/k RMSNorm over each head before RoPE; `attention_bias` puts biases on q, k, v *and*
o), dense SiLU MLPs, plain RoPE (any `rope_scaling` raises there), shifted logits (position i predicts token i+1).

Traps: (1) the attention ignores every mask — `CoDAModel` builds a causal mask and the sampler a padding mask, but the
attention module never reads either, so the model is always fully bidirectional over every row, pads included.
mdm_lens's forward honours an `attention_mask` you pass (a deliberate difference, visible only with padding); the
`coda` sampler refuses padded batches rather than diverge from the reference silently. (2) `tie_word_embeddings`
defaults to true in `CoDAConfig`, yet nothing ties: the checkpoint carries its own `lm_head.weight`, which is what
the reference uses — so mdm_lens never ties either. (3) the output reshape needs `num_attention_heads · head_dim ==
hidden_size`; other values fail in the reference and are refused here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan

# CoDAConfig.__init__ defaults (model_config.py)
REFERENCE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643, "mask_token_id": 151669,
}


def config_from_coda(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import in_vocab

    def get(key: str) -> Any:
        return config[key] if key in config else REFERENCE_DEFAULTS[key]

    if get("hidden_act") != "silu":
        raise ConfigError(f"CoDA hidden_act={get('hidden_act')!r}; only SiLU-gated MLPs are supported.")
    if get("rope_scaling") is not None:
        raise ConfigError(f"CoDA rope_scaling={get('rope_scaling')!r}: the reference raises NotImplementedError for "
                          "any scaling, so no trained CoDA uses it.")
    d_model, n_heads, d_head = get("hidden_size"), get("num_attention_heads"), get("head_dim")
    if n_heads * d_head != d_model:
        raise ConfigError(f"CoDA needs num_attention_heads·head_dim == hidden_size (its attention output is reshaped "
                          f"to hidden_size); got {n_heads}·{d_head} != {d_model}.")
    bias = bool(get("attention_bias"))
    d_vocab = get("vocab_size")
    n_kv = get("num_key_value_heads") or n_heads
    return MDMConfig(
        d_model=d_model, n_layers=get("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_mlp=get("intermediate_size"), d_vocab=d_vocab, n_ctx=get("max_position_embeddings"),
        rope_theta=float(get("rope_theta")), norm_eps=float(get("rms_norm_eps")), qkv_bias=bias,
        attention="bidirectional", logit_shift=True, rope_full_precision=False, position_policy="arange",
        padding_mask="key", tie_word_embeddings=False,  # CoDA never ties, whatever tie_word_embeddings says
        mask_token_id=in_vocab(get("mask_token_id"), d_vocab), pad_token_id=in_vocab(get("pad_token_id"), d_vocab),
        bos_token_id=in_vocab(get("bos_token_id"), d_vocab), eos_token_id=in_vocab(get("eos_token_id"), d_vocab),
        family="coda", model_name=name,
        extra={"arch": "coda", "qk_norm": True, "o_bias": bias, "moe_layers": [False] * get("num_hidden_layers"),
               "ignores_attention_mask": True},
    )


def coda_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.loading.family_parts import hf_layout_plan

    return hf_layout_plan(cfg, bias=None, shared=None)
