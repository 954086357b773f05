"""A thin layer over the two tokenizer kinds we meet: `tokenizers.Tokenizer` (our zoo, raw
`tokenizer.json` files) and transformers' `PreTrainedTokenizerBase` (real checkpoints)."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import InputError, InputTypeError


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


def unknown_ids_in(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The positions of `ids` that are the tokenizer's unknown token (text it could not spell)."""
    unk = unknown_token_ids(tokenizer)
    return [i for i, t in enumerate(ids) if int(t) in unk]


def unknown_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's unknown-token id(s): transformers' ``unk_token_id``, a ``tokenizers`` model's
    ``unk_token``; empty for byte-level vocabularies, which can spell any text."""
    ids: set[int] = set()
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(unk, int):
        ids.add(unk)
    model = getattr(tokenizer, "model", None)
    name = getattr(model, "unk_token", None)
    if isinstance(name, str) and hasattr(tokenizer, "token_to_id"):
        i = tokenizer.token_to_id(name)
        if i is not None:
            ids.add(int(i))
    return ids


def require(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise InputError(
            "this model has no tokenizer: pass token ids (a LongTensor [batch, pos]) instead of text, or "
            "attach one with `model.set_tokenizer(tok)` (a `tokenizers.Tokenizer` or a transformers tokenizer)."
        )
    return tokenizer


def to_tokens(model: Any, text: Any, prepend_bos: bool | None, padding_side: str,
              return_attention_mask: bool) -> Any:
    """`HookedMDM.to_tokens`: ids `[batch, pos]` (and the 0/1 mask), padded with the pad id, never the mask id."""
    tok = require(model.tokenizer)
    if isinstance(text, str):
        texts = [text]
    elif isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
        texts = list(text)
    else:
        raise InputTypeError(f"text={validate.describe(text)} is invalid: expected a str or a non-empty list of str.",
                             argument="text", value=text, allowed="a str or a non-empty list of str")
    if prepend_bos is not None:
        validate.boolean(prepend_bos, name="prepend_bos")
    padding_side = validate.choice(padding_side, ("left", "right"), name="padding_side", error=InputError)
    validate.boolean(return_attention_mask, name="return_attention_mask")
    cfg = model.cfg
    bos = cfg.bos_token_id
    add_bos = (cfg.extra.get("prepend_bos", False) if prepend_bos is None else prepend_bos) and bos is not None
    rows = [([bos] if add_bos else []) + encode(tok, t) for t in texts]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise InputError(f"text {empty[0]} ({texts[empty[0]]!r}) tokenizes to no tokens; a model input needs at least "
                         "one.", argument="text", value=text, allowed="texts of at least one token")
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    if pad is None:
        pad = 0
    if pad == cfg.mask_token_id:
        raise InputError(f"the pad id equals the mask id {pad}; set cfg.pad_token_id to another token.")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    am = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        am[i, sl] = 1
    device = model.input_device
    return (ids.to(device), am.to(device)) if return_attention_mask else ids.to(device)


def _vocab_ids(model: Any, tokens: Any) -> Tensor:
    """Token ids checked against the model's vocabulary (the forward's range): an id past it decodes to '' or a
    placeholder, a negative one overflows inside the tokenizer."""
    t = _id_tensor(tokens)
    n = model.cfg.d_vocab
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
        from mdm_lens.errors import OutOfRangeError

        raise OutOfRangeError(f"tokens holds id {bad}: token ids must lie in [0, {n}) (the vocabulary).",
                              argument="tokens", value=bad, allowed=f"ids in [0, {n})")
    return t


def _id_tensor(tokens: Any) -> Tensor:
    if isinstance(tokens, str):
        raise InputTypeError("expected token ids, got a str; decode ids, or use to_tokens for text.",
                             argument="tokens", value=tokens, allowed="token ids")
    try:
        t = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputTypeError(f"tokens={validate.describe(tokens)} is invalid: expected token ids ({e}).",
                             argument="tokens", value=tokens, allowed="token ids") from e
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputTypeError(f"tokens={validate.describe(t)} is invalid: expected integer token ids.",
                             argument="tokens", value=tokens, allowed="an integer tensor or list of ints")
    return t


def to_string(model: Any, tokens: Any) -> str | list[str]:
    """TL's rule: a 2-d input gives one string per row; a 1-d or 0-d one (or an int) gives one string."""
    tok = require(model.tokenizer)
    t = _vocab_ids(model, tokens)
    if t.ndim == 2:
        return [decode(tok, row.tolist()) for row in t]
    if t.ndim > 2:
        raise InputError(f"to_string takes [batch, pos], [pos] or a single id, got shape {tuple(t.shape)}.",
                         argument="tokens", value=tokens, allowed="at most 2 dimensions")
    return decode(tok, t.reshape(-1).tolist())


def to_str_tokens(model: Any, tokens: Any) -> list[str]:
    tok = require(model.tokenizer)
    if isinstance(tokens, str):
        tokens = model.to_tokens(tokens)[0]
    t = _vocab_ids(model, tokens)
    if t.ndim == 2:
        if t.shape[0] != 1:
            raise InputError("to_str_tokens takes one sequence; index the batch first.", argument="tokens",
                             value=tokens, allowed="one sequence")
        t = t[0]
    if t.ndim > 1:
        raise InputError(f"to_str_tokens takes [pos] or [1, pos], got shape {tuple(t.shape)}.", argument="tokens",
                         value=tokens, allowed="one sequence")
    mask_id = model.cfg.mask_token_id
    return ["[MASK]" if int(i) == mask_id else id_to_token(tok, int(i)) for i in t.reshape(-1)]


class TokenizerMethods:
    """TransformerLens' tokenizer helpers (`to_tokens`, `to_string`, `to_str_tokens`, `to_single_token`,
    `set_tokenizer`) for any model class with `tokenizer` and `cfg` (HookedMDM, HookedDDiT): the work is in the
    functions above, so every family tokenizes the same way."""

    tokenizer: Any

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None,
                  padding_side: Literal["left", "right"] = "left", return_attention_mask: bool = False) -> Any:
        """Tokenize one text or a batch; batches are padded (left by default) with the pad id, never the mask id."""
        return to_tokens(self, text, prepend_bos, padding_side, return_attention_mask)

    def to_string(self, tokens: Tensor | Sequence[int] | int) -> str | list[str]:
        """Decode `[batch, pos]` to a list of strings, `[pos]` or a 0-d tensor / int to one string (as TL)."""
        return to_string(self, tokens)

    def to_str_tokens(self, tokens: Tensor | Sequence[int] | str) -> list[str]:
        """One string per token; mask tokens are shown as `[MASK]` whatever the vocabulary calls them."""
        return to_str_tokens(self, tokens)

    def to_single_token(self, string: str) -> int:
        tok = require(self.tokenizer)
        if not isinstance(string, str):
            raise InputTypeError(f"string={validate.describe(string)} is invalid: expected a str.", argument="string",
                                 value=string, allowed="a str")
        ids = encode(tok, string)
        if len(ids) != 1:
            raise InputError(f"{string!r} is {len(ids)} tokens, not one.", argument="string", value=string,
                             allowed="a string that is exactly one token")
        if unknown_ids_in(tok, ids) and decode(tok, ids).strip() != string.strip():
            # a word the vocabulary cannot spell maps to <unk>: its logit / direction would be <unk>'s
            raise InputError(f"{string!r} tokenizes to the unknown token (id {int(ids[0])}): this tokenizer cannot "
                             "spell it, so its logit would be the <unk> token's. Pass a string it spells, or the id.",
                             argument="string", value=string, allowed="a string the tokenizer spells as one token")
        return int(ids[0])
