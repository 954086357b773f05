"""Text → token ids for the probes, always with the tokenizer the caller's model carries.

The probes never reach for the zoo tokenizer behind a model's back: a model without a tokenizer (a
`HookedMDM.from_config` stand-in) gets a typed error saying what to pass instead, so regions, answers
and retrieval spans can never be computed in one vocabulary and read in another.
"""

from __future__ import annotations

from typing import Any

from mdm_lens.errors import ArgumentError

__all__ = ["model_tokenizer", "encode_with_offsets"]

_HOW = ("set one with model.set_tokenizer(tokenizer) (for a stand-in over the zoo vocabulary: "
        "mdm_lens.zoo.tokenizer.load_tokenizer())")


def model_tokenizer(model: Any, argument: str, value: Any, instead: str) -> Any:
    """`model.tokenizer`, or an ArgumentError naming `argument` and what to pass `instead` of text."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ArgumentError(f"{argument}={value!r:.80} is text but the model has no tokenizer: pass {instead}, or "
                            f"{_HOW}.", argument=argument, value=value, allowed=instead)
    return tokenizer


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` (no special tokens added) and each token's half-open character offsets, from ONE
    tokenisation, for a `tokenizers.Tokenizer` or a transformers fast tokenizer."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        enc = tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
