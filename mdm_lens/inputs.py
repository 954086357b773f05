"""Checks of `HookedMDM.forward`'s inputs: token ids, the HF-style `attention_mask`, explicit `attn_mask`
and `position_ids`. Each bad input raises a typed error (`InputError`, `InputTypeError`) that names the
argument, the value and what is expected, before any compute.

Padding: pads are hidden as keys through `attention_mask` (1 = real token, 0 = pad). With absolute
positions (LLaDA, Llama/Qwen2 without `position_ids`) a *right*-padded row gives each real position the
logits it has alone (its positions are unchanged and it never sees a pad), and so it does for Dream's
cumulative positions; a *left*-padded row keeps the reference's own semantics (LLaDA shifts the real
tokens' positions by the pad count, as the reference does). Leading pad ids without an `attention_mask`
are attended as real tokens, so they get a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import InputError, InputTypeError

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def token_ids(tokens: Any, cfg: MDMConfig, device: torch.device | str) -> Int[Tensor, "batch pos"]:
    """Token ids as a long tensor `[batch, pos]` on `device` (a `[pos]` input is one sequence)."""
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        raise InputTypeError("forward takes token ids; use `model.to_tokens(text)` first (or "
                             "`model(model.to_tokens(text))`).", argument="tokens", value=tokens,
                             allowed="an integer tensor [batch, pos]")
    if not isinstance(tokens, Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputTypeError(f"tokens={validate.describe(tokens)} is invalid: expected an integer tensor [batch, pos] "
                                 f"or a (nested) list of ints ({e}).", argument="tokens", value=tokens,
                                 allowed="an integer tensor [batch, pos]") from e
    if tokens.numel() == 0:
        raise InputError(f"tokens={validate.describe(tokens)} is empty: expected at least one sequence of at least one "
                         "token.", argument="tokens", value=tokens, allowed="a non-empty [batch, pos] tensor")
    if tokens.dtype not in _INT_DTYPES:
        raise InputTypeError(f"tokens={validate.describe(tokens)} is invalid: expected integer token ids (int64 or int32), "
                             f"not {tokens.dtype}.", argument="tokens", value=tokens, allowed="an integer tensor")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InputError(f"tokens={validate.describe(tokens)} is invalid: expected shape [batch, pos] or [pos].",
                         argument="tokens", value=tokens, allowed="[batch, pos]")
    if tokens.shape[1] > cfg.n_ctx:
        raise InputError(f"sequence of {tokens.shape[1]} tokens exceeds the context of {cfg.n_ctx}; "
                         "truncate the input or shorten gen_length.", argument="tokens", value=tokens,
                         allowed=f"at most {cfg.n_ctx} positions")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.d_vocab:
        raise InputError(f"token ids must lie in [0, {cfg.d_vocab}), got range [{lo}, {hi}].", argument="tokens",
                         value=tokens, allowed=f"ids in [0, {cfg.d_vocab})")
    return tokens.to(device=device, dtype=torch.long)


def like_tokens(value: Tensor, tokens: Tensor, name: str, meaning: str) -> Tensor:
    """A per-position tensor of the tokens' shape (`[pos]` is taken as one row when the batch is one row)."""
    if value.ndim == 1 and tokens.shape[0] == 1:
        value = value[None]
    if tuple(value.shape) != tuple(tokens.shape):
        raise InputError(f"{name} shape {tuple(value.shape)} must equal tokens shape {tuple(tokens.shape)} "
                         f"({meaning}).", argument=name, value=value, allowed=f"shape {tuple(tokens.shape)}")
    return value


def attention_mask(mask: Any, tokens: Tensor, cfg: MDMConfig, warn_pads: bool = True
                   ) -> Int[Tensor, "batch pos"] | None:
    """The `[batch, pos]` padding mask as a long 0/1 tensor on the tokens' device; None = no padding.
    `warn_pads=False`: no left-pad warning (a sampler's window forward, whose first token is a generated one)."""
    if mask is None:
        if warn_pads:
            warn_leading_pads(tokens, cfg)
        return None
    if not isinstance(mask, Tensor):
        raise InputTypeError(f"attention_mask={validate.describe(mask)} is invalid: expected a tensor [batch, pos] of 0/1 "
                             "(1 = real token, 0 = padding).", argument="attention_mask", value=mask,
                             allowed="a 0/1 tensor [batch, pos]")
    if mask.dtype == torch.bool or mask.dtype in _INT_DTYPES or mask.is_floating_point():
        pass
    else:
        raise InputTypeError(f"attention_mask has dtype {mask.dtype}; expected bool or integer 0/1.",
                             argument="attention_mask", value=mask, allowed="a bool or integer tensor")
    mask = like_tokens(mask, tokens, "attention_mask", "1 = real token, 0 = padding")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError(f"attention_mask holds values other than 0 and 1 ({sorted(set(mask.unique().tolist()))[:6]})"
                         "; it marks real tokens (1) and padding (0).", argument="attention_mask", value=mask,
                         allowed="values 0 and 1")
    mask = mask.to(device=tokens.device, dtype=torch.long)
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask row(s) {empty} are all zero: such a row has no real token, so every one "
                         "of its attention rows would be undefined. Drop those rows or mark their tokens with 1.",
                         argument="attention_mask", value=mask, allowed="at least one 1 per row")
    mask_id = cfg.mask_token_id
    if mask_id is not None and bool(((mask == 0) & (tokens == mask_id)).any()):
        raise InputError(f"padding uses the mask token id {mask_id}: the model would read pads as positions "
                         "to denoise. Pad with the pad/EOS id instead (LLaDA asserts the same).",
                         argument="attention_mask", value=mask, allowed="pads that are not the mask id")
    return mask


def warn_leading_pads(tokens: Tensor, cfg: MDMConfig) -> None:
    """Rows that start with the pad id look left-padded; without a mask those pads are attended (the warning
    TransformerLens users get used to seeing handled for them, made explicit here)."""
    pad = cfg.pad_token_id
    if pad is None or pad == cfg.bos_token_id or pad == cfg.mask_token_id:
        return
    rows = (tokens[:, 0] == pad).nonzero().flatten().tolist()
    if rows and tokens.shape[1] > 1 and bool((tokens[rows] != pad).any()):
        warnings.warn(f"{len(rows)} row(s) of tokens (e.g. row {rows[0]}) start with the pad id {pad} but no "
                      "attention_mask was given, so those pads are attended as real tokens. Pass the mask "
                      "(`tokens, mask = model.to_tokens(texts, return_attention_mask=True)`; "
                      "`model(tokens, attention_mask=mask)`).", UserWarning, stacklevel=4)


def warn_trailing_pads(tokens: Tensor, cfg: MDMConfig, where: str) -> None:
    """Rows that end in a run of pad ids look right-padded (`generate_final` pads that way); the forward's own
    heuristic only reads leading pads (a sampler's canvases legitimately end in anything), so the probes that take
    an `attention_mask` call this when none was given. Skipped where the pad id is also BOS / mask / EOS: a
    generated answer ends in EOS ids, which the reference attends."""
    pad = cfg.pad_token_id
    if pad is None or pad in (cfg.bos_token_id, cfg.mask_token_id, cfg.eos_token_id) or tokens.shape[1] < 2:
        return
    rows = ((tokens[:, -1] == pad) & (tokens != pad).any(-1)).nonzero().flatten().tolist()
    if rows:
        n = int((tokens[rows[0]] != pad).long().cumsum(0).argmax()) + 1  # the first row's length before its pads
        warnings.warn(f"{where}: {len(rows)} row(s) of tokens (e.g. row {rows[0]}, pads from position {n}) end in "
                      f"the pad id {pad} but no attention_mask was given, so those pads are counted as real tokens "
                      "(queries and keys). Pass the mask (generate_final returns it: `tokens, mask, _ = "
                      f"generate_final(...)`; `{where}(..., attention_mask=mask)`).", UserWarning, stacklevel=4)


def explicit_mask(attn_mask: Any, tokens: Tensor) -> Bool[Tensor, "batch 1 query key"] | None:
    if attn_mask is None:
        return None
    n = tokens.shape[1]
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        raise InputTypeError(f"attn_mask={validate.describe(attn_mask)} is invalid: expected a bool tensor [{n}, {n}] or "
                             f"[batch|1, 1, {n}, {n}] (True = may attend).", argument="attn_mask", value=attn_mask,
                             allowed="a bool tensor")
    if attn_mask.ndim == 2:
        attn_mask = attn_mask[None, None]
    ok = (attn_mask.ndim == 4 and attn_mask.shape[-2:] == (n, n) and attn_mask.shape[1] == 1
          and attn_mask.shape[0] in (1, tokens.shape[0]))
    if not ok:
        raise InputError(f"attn_mask must be bool [..., {n}, {n}] (True = may attend), shaped [{n}, {n}] or "
                         f"[batch|1, 1, {n}, {n}]; got {tuple(attn_mask.shape)}.", argument="attn_mask",
                         value=attn_mask, allowed=f"[{n}, {n}] or [batch|1, 1, {n}, {n}]")
    # A query that sees no key is allowed only as Dream's pair mask makes pads: the position is hidden both as a
    # query and as a key, so nothing ever reads its (undefined) output. Any other blind row is a mistake.
    dead = (~attn_mask.flatten(1).any(-1)).nonzero().flatten().tolist()
    if dead:  # every position a "pad": no query of that row attends to anything, so nothing it computes is defined
        raise InputError(f"attn_mask hides every key from every query of batch row {dead[0]}: its attention (and "
                         "every activation after it) would be undefined. Let every query see at least one key.",
                         argument="attn_mask", value=attn_mask, allowed="at least one True per batch row")
    blind = (~attn_mask.any(-1) & attn_mask.any(-2)).nonzero().tolist()
    if blind:
        raise InputError(f"attn_mask hides every key from query position {blind[0][-1]} (batch {blind[0][0]}): its "
                         "attention would be undefined. Let every query see at least one key.",
                         argument="attn_mask", value=attn_mask, allowed="at least one True per query row")
    return attn_mask.to(tokens.device)


def position_ids(value: Any, tokens: Tensor) -> Int[Tensor, "batch pos"]:
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputTypeError(f"position_ids={validate.describe(value)} is invalid: expected an integer tensor "
                                 f"[batch, pos] ({e}).", argument="position_ids", value=value,
                                 allowed="an integer tensor") from e
    if value.dtype not in _INT_DTYPES:
        raise InputTypeError(f"position_ids has dtype {value.dtype}; expected integer positions.",
                             argument="position_ids", value=value, allowed="an integer tensor")
    b, t = tokens.shape
    if value.ndim == 1:
        value = value[None]
    if value.ndim != 2 or value.shape[1] != t or value.shape[0] not in (1, b):
        raise InputError(f"position_ids shape {tuple(value.shape)} does not fit tokens {tuple(tokens.shape)}: "
                         f"expected [{t}], [1, {t}] or [{b}, {t}].", argument="position_ids", value=value,
                         allowed=f"[{b}, {t}]")
    if bool((value < 0).any()):
        raise InputError(f"position_ids must be >= 0, got a minimum of {int(value.min())}.", argument="position_ids",
                         value=value, allowed="non-negative positions")
    return value.to(tokens.device).expand(b, t)


def default_block_length(cfg: MDMConfig) -> int | None:
    """The forward's block length when none is passed: `cfg.extra["block_length"]`. A block-causal model without
    one attends bidirectionally, while the block samplers fall back to their reference's default (LLaDA2 32,
    SDAR 4): said, so a plain forward and a sampler's forwards are not silently two different masks."""
    block_length = cfg.extra.get("block_length")
    if block_length is None and cfg.attention == "block_causal":
        warnings.warn(f"{cfg.model_name}: attention='block_causal' with no cfg.extra['block_length'], so this forward "
                      "attends bidirectionally (the block samplers would use their reference default instead); set "
                      "cfg.extra['block_length'] or pass block_length=.", UserWarning, stacklevel=4)
    return block_length
