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


_IDS = {"mask_token_id": _or_null(token_id), "bos_token_id": _or_null(token_id), "pad_token_id": _or_null(token_id),
        "eos_token_id": _or_null(token_ids)}
HF_SCHEMA: dict[str, Check] = {
    "hidden_size": positive_int, "intermediate_size": positive_int, "num_hidden_layers": positive_int,
    "num_attention_heads": positive_int, "vocab_size": positive_int, "max_position_embeddings": positive_int,
    "num_key_value_heads": _or_null(positive_int), "head_dim": _or_null(positive_int),
    "rms_norm_eps": nonnegative_number, "tie_word_embeddings": is_bool, "attention_bias": is_bool,
    "mlp_bias": is_bool, "use_sliding_window": is_bool, **_IDS,
}
LLADA_SCHEMA: dict[str, Check] = {
    "d_model": positive_int, "n_heads": positive_int, "n_layers": positive_int, "vocab_size": positive_int,
    "max_sequence_length": positive_int, "n_kv_heads": _or_null(positive_int),
    "mlp_hidden_size": _or_null(positive_int), "mlp_ratio": positive_int, "embedding_size": _or_null(positive_int),
    "rms_norm_eps": nonnegative_number, "rope_theta": lambda v: nonnegative_number(v) and v > 0,
    "weight_tying": is_bool, "include_qkv_bias": is_bool, "rope_full_precision": is_bool,
    "multi_query_attention": _or_null(is_bool), **_IDS,
}
_WHAT = {positive_int: "an int > 0", nonnegative_number: "a finite number >= 0", is_bool: "true or false",
         token_id: "an int >= 0", token_ids: "an int >= 0 or a list of them"}


def _describe(check: Check) -> str:
    if check in _WHAT:
        return _WHAT[check]
    if check.__name__.endswith(" or null"):
        inner = check.__name__.removesuffix(" or null")
        named = {f.__name__: w for f, w in _WHAT.items()}
        return f"{named.get(inner, inner)} or null"
    return "a finite number > 0"


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
            if i is not None and not 0 <= i < d_vocab:
                raise ConfigError(f"{key}={value!r} from config.json ({path}) is outside the vocabulary [0, "
                                  f"{d_vocab}) of this checkpoint (its embedding has that many rows); fix the id.")
