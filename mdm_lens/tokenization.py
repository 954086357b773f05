"""A thin layer over the two tokenizer kinds we meet: `tokenizers.Tokenizer` (our zoo, raw
`tokenizer.json` files) and transformers' `PreTrainedTokenizerBase` (real checkpoints)."""

from __future__ import annotations

from typing import Any, Sequence

from mdm_lens.errors import InputError


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def id_to_token(tokenizer: Any, i: int) -> str:
    if hasattr(tokenizer, "id_to_token"):
        return tokenizer.id_to_token(int(i)) or f"<{i}>"
    return tokenizer.convert_ids_to_tokens(int(i))


def token_to_id(tokenizer: Any, token: str) -> int | None:
    if hasattr(tokenizer, "token_to_id"):
        return tokenizer.token_to_id(token)
    i = tokenizer.convert_tokens_to_ids(token)
    return None if i == getattr(tokenizer, "unk_token_id", None) else i


def require(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise InputError(
            "this model has no tokenizer: pass token ids (a LongTensor [batch, pos]) instead of text, or "
            "attach one with `model.set_tokenizer(tok)` (a `tokenizers.Tokenizer` or a transformers tokenizer)."
        )
    return tokenizer
