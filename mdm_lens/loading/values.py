"""Type and range checks of every `config.json` value a family converter reads, before it is used.

A value of the wrong JSON type or range (a null hidden size, `"n_heads": "32"`, a negative vocabulary, a
mask id outside the vocabulary) is a `ConfigError` at load that names the key and the file, instead of a
TypeError deep in the converter or a wrong token blamed on the prompt later. Keys that are absent take the
reference default (see loading/hf.py and loading/llada.py); rotary keys are checked in loading/rope.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from mdm_lens.errors import ConfigError

Check = Callable[[Any], bool]


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def nonnegative_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _or_null(check: Check) -> Check:
    def allowed(value: Any) -> bool:
        return value is None or check(value)

    allowed.__doc__ = f"{check.__name__} or null"
    allowed.__name__ = f"{check.__name__} or null"
    return allowed


def token_id(value: Any) -> bool:
    return _int(value) and value >= 0


def token_ids(value: Any) -> bool:
    """An id or a non-empty list of ids (transformers allows a list for eos_token_id)."""
    return token_id(value) or (isinstance(value, list) and bool(value) and all(token_id(v) for v in value))


def finite_positive(value: Any) -> bool:
    return nonnegative_number(value) and value > 0


def unit_fraction(value: Any) -> bool:
    """A fraction of the head that is rotated: in (0, 1]."""
    return finite_positive(value) and value <= 1


def rate(value: Any) -> bool:
    """A dropout or mixing probability: in [0, 1) (1 would drop / replace everything)."""
    return nonnegative_number(value) and value < 1


def unit_interval(value: Any) -> bool:
    """A time on the diffusion clock: in [0, 1]."""
    return nonnegative_number(value) and value <= 1


def time_margin(value: Any) -> bool:
    """GIDD's `t_eps`: in [0, 0.5) (its time grid (1 − 2·eps)·u + eps runs backwards from 0.5 on)."""
    return nonnegative_number(value) and value < 0.5


def nonnegative_int(value: Any) -> bool:
    return _int(value) and value >= 0


def layer_list(value: Any) -> bool:
    """A list of layer indices (`mlp_only_layers`) or of 0/1 flags (`moe_layer_freq`)."""
    return isinstance(value, list) and all(nonnegative_int(v) for v in value)


_IDS = {"mask_token_id": _or_null(token_id), "bos_token_id": _or_null(token_id), "pad_token_id": _or_null(token_id),
        "eos_token_id": _or_null(token_ids)}
# the sampler's block length a block-diffusion checkpoint may name (LLaDA2, SDAR): never replaced by a default
_BLOCK = {"block_length": positive_int, "block_size": positive_int}
_SIZES = {"hidden_size": positive_int, "num_hidden_layers": positive_int, "num_attention_heads": positive_int,
          "vocab_size": positive_int, "max_position_embeddings": positive_int,
          "head_dim": _or_null(positive_int), "rms_norm_eps": nonnegative_number, "tie_word_embeddings": is_bool,
          "rope_theta": finite_positive}
HF_SCHEMA: dict[str, Check] = {
    **_SIZES, "intermediate_size": positive_int, "num_key_value_heads": _or_null(positive_int),
    "attention_bias": is_bool, "mlp_bias": is_bool, "use_sliding_window": is_bool, **_IDS,
}
FASTDLLM_V2_SCHEMA: dict[str, Check] = {**HF_SCHEMA, "bd_size": positive_int}
LLADA_SCHEMA: dict[str, Check] = {
    "d_model": positive_int, "n_heads": positive_int, "n_layers": positive_int, "vocab_size": positive_int,
    "max_sequence_length": positive_int, "n_kv_heads": _or_null(positive_int),
    "mlp_hidden_size": _or_null(positive_int), "mlp_ratio": positive_int, "embedding_size": _or_null(positive_int),
    "rms_norm_eps": nonnegative_number, "rope_theta": finite_positive,
    "weight_tying": is_bool, "include_qkv_bias": is_bool, "rope_full_precision": is_bool,
    "multi_query_attention": _or_null(is_bool), **_IDS,
}
LLADA2_SCHEMA: dict[str, Check] = {
    **_SIZES, **_BLOCK, "intermediate_size": _or_null(positive_int), "num_key_value_heads": positive_int,
    "use_qkv_bias": is_bool, "use_qk_norm": is_bool, "use_bias": is_bool, "use_sliding_window": is_bool,
    "partial_rotary_factor": unit_fraction, "num_experts": _or_null(positive_int),
    "num_shared_experts": _or_null(nonnegative_int), "num_experts_per_tok": positive_int, "n_group": positive_int,
    "topk_group": positive_int, "routed_scaling_factor": finite_positive,
    "moe_intermediate_size": _or_null(positive_int), "first_k_dense_replace": nonnegative_int, **_IDS,
}
LLADAMOE_SCHEMA: dict[str, Check] = {
    **_SIZES, "dense_intermediate_size": positive_int, "expert_intermediate_size": positive_int,
    "shared_expert_intermediate_size": _or_null(positive_int), "num_key_value_heads": _or_null(positive_int),
    "partial_rotary_factor": unit_fraction, "attention_bias": is_bool, "clip_qkv": _or_null(finite_positive),
    "num_experts_per_tok": positive_int, "num_experts": positive_int, "qk_layernorm": _or_null(is_bool),
    "moe_layer_freq": layer_list, "moe_router_enable_expert_bias": _or_null(is_bool), **_IDS,
}
SDAR_SCHEMA: dict[str, Check] = {
    **_SIZES, **_BLOCK, "intermediate_size": positive_int, "num_key_value_heads": _or_null(positive_int),
    "attention_bias": is_bool, "use_sliding_window": is_bool, **_IDS,
}
SDAR_MOE_SCHEMA: dict[str, Check] = {
    **SDAR_SCHEMA, "decoder_sparse_step": positive_int, "num_experts": nonnegative_int,
    "num_local_experts": nonnegative_int, "num_experts_per_tok": positive_int, "moe_intermediate_size": positive_int,
    "norm_topk_prob": is_bool, "mlp_only_layers": _or_null(layer_list),
}
# the DDiT hub configs (MDLMConfig, DUOConfig; families-2.md §2.2, §4.1)
DDIT_SCHEMA: dict[str, Check] = {
    "vocab_size": positive_int, "model_length": positive_int, "hidden_dim": positive_int, "cond_dim": positive_int,
    "n_blocks": positive_int, "n_heads": positive_int, "dropout": rate, "time_conditioning": is_bool,
    "causal": is_bool,
}


def nemotron_mask_id(value: Any) -> bool:
    """An int >= 0, or -1 (NemotronLabsDiffusionConfig's default: no mask token)."""
    return _int(value) and value >= -1


NEMOTRON_SCHEMA: dict[str, Check] = {
    **_SIZES, **_IDS, "intermediate_size": positive_int, "num_key_value_heads": _or_null(positive_int),
    "attention_bias": is_bool, "mlp_bias": is_bool, "block_size": positive_int,
    "mask_token_id": _or_null(nemotron_mask_id), "sliding_window": _or_null(positive_int),
}
RND1_SCHEMA: dict[str, Check] = {
    **_SIZES, "intermediate_size": positive_int, "num_key_value_heads": positive_int, "attention_bias": is_bool,
    "use_sliding_window": is_bool, "decoder_sparse_step": positive_int, "num_experts": positive_int,
    "num_experts_per_tok": positive_int, "moe_intermediate_size": positive_int, "norm_topk_prob": is_bool,
    "mlp_only_layers": _or_null(layer_list), **_IDS,
}
CODA_SCHEMA: dict[str, Check] = {
    **_SIZES, "intermediate_size": positive_int, "num_key_value_heads": _or_null(positive_int),
    "attention_bias": is_bool, "use_sliding_window": is_bool, **_IDS,
}
SCHEMAS: dict[str, dict[str, Check]] = {
    "llama": HF_SCHEMA, "qwen2": HF_SCHEMA, "dream": HF_SCHEMA, "fastdllm_v2": FASTDLLM_V2_SCHEMA,
    "llada": LLADA_SCHEMA, "llada2_moe": LLADA2_SCHEMA, "lladamoe": LLADAMOE_SCHEMA, "sdar": SDAR_SCHEMA,
    "sdar_moe": SDAR_MOE_SCHEMA, "mdlm": DDIT_SCHEMA, "duo": DDIT_SCHEMA, "nemotron_dllm": NEMOTRON_SCHEMA,
    "rnd1": RND1_SCHEMA, "coda": CODA_SCHEMA,
}
_WHAT = {positive_int: "an int > 0", nonnegative_number: "a finite number >= 0", is_bool: "true or false",
         token_id: "an int >= 0", token_ids: "an int >= 0 or a list of them", finite_positive: "a finite number > 0",
         unit_fraction: "a number in (0, 1]", nonnegative_int: "an int >= 0",
         layer_list: "a list of ints >= 0", nemotron_mask_id: "an int >= -1 (-1: no mask token)",
         rate: "a number in [0, 1)", unit_interval: "a number in [0, 1]", time_margin: "a number in [0, 0.5)"}


def _describe(check: Check) -> str:
    if check in _WHAT:
        return _WHAT[check]
    if check.__name__.endswith(" or null"):
        inner = check.__name__.removesuffix(" or null")
        named = {f.__name__: w for f, w in _WHAT.items()}
        return f"{named.get(inner, inner)} or null"
    return check.__doc__ or check.__name__


def check_raw(raw: dict[str, Any], schema: dict[str, Check], path: Path) -> None:
    """Every key of `schema` that `raw` holds has the right JSON type and range."""
    for key, check in schema.items():
        if key in raw and not check(raw[key]):
            raise ConfigError(f"{path}: {key}={raw[key]!r} is invalid: expected {_describe(check)}.")


def check_ids_in_vocab(raw: dict[str, Any], d_vocab: int, path: Path) -> None:
    """A special-token id config.json gives must name a row of the embedding (`[0, d_vocab)`)."""
    for key in _IDS:
        value = raw.get(key)
        for i in value if isinstance(value, list) else [value]:
            if key == "mask_token_id" and i == -1:  # Nemotron's "no mask token" (other schemas refuse -1)
                continue
            if i is not None and not 0 <= i < d_vocab:
                raise ConfigError(f"{key}={value!r} from config.json ({path}) is outside the vocabulary [0, "
                                  f"{d_vocab}) of this checkpoint (its embedding has that many rows); fix the id.")
