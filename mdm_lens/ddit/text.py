"""The TransformerLens tokenizer helpers of `HookedDDiT` (`to_tokens`, `to_string`, `to_str_tokens`,
`to_single_token`, `set_tokenizer`), the same functions `HookedMDM` uses (`mdm_lens.tokenization`), so probes and
views that render tokens work on MDLM / Duo."""

from __future__ import annotations

from typing import Any, Literal, Sequence

from torch import Tensor

from mdm_lens import tokenization, validate
from mdm_lens.errors import InputError, InputTypeError


class TokenizerMethods:
    tokenizer: Any

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None,
                  padding_side: Literal["left", "right"] = "left", return_attention_mask: bool = False) -> Any:
        return tokenization.to_tokens(self, text, prepend_bos, padding_side, return_attention_mask)

    def to_string(self, tokens: Tensor | Sequence[int] | int) -> str | list[str]:
        return tokenization.to_string(self, tokens)

    def to_str_tokens(self, tokens: Tensor | Sequence[int] | str) -> list[str]:
        """One string per token; MDLM's mask id is shown as `[MASK]`."""
        return tokenization.to_str_tokens(self, tokens)

    def to_single_token(self, string: str) -> int:
        tok = tokenization.require(self.tokenizer)
        if not isinstance(string, str):
            raise InputTypeError(f"string={validate.describe(string)} is invalid: expected a str.", argument="string",
                                 value=string, allowed="a str")
        ids = tokenization.encode(tok, string)
        if len(ids) != 1:
            raise InputError(f"{string!r} is {len(ids)} tokens, not one.", argument="string", value=string,
                             allowed="a string that is one token")
        return int(ids[0])
