"""The checks every sampler shares: the prompt and its padding, top-p / top-k filters, the idle-steps warning.
Each sampler's own settings (with the reference defaults) live in its module (`llada.LLaDASettings`,
`dream.DreamSettings`, `arm.ARMSettings`, ...) and are resolved through `mdm_lens.diffusion.registry`; errors are
the typed ones of `mdm_lens.errors`, raised through `mdm_lens.validate` before any compute."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.registry import DEFAULT  # noqa: F401  (public: mdm_lens.diffusion.DEFAULT)
from mdm_lens.errors import ArgumentTypeError, InputError, SamplerConfigError
from mdm_lens.inputs import warn_leading_pads


class IdleStepsWarning(UserWarning):
    """More steps than tokens: some denoising steps commit nothing (the reference runs them anyway)."""


class ReferenceQuirkWarning(UserWarning):
    """A reference quirk the run reproduced changed what a caller would expect (e.g. SDAR rewriting prompt tokens);
    the message names the steps and positions."""


class MaskedAnswerWarning(UserWarning):
    """A run ended with the mask id in its returned answer span: the model sampled the mask token itself, or the
    block's steps ran out before every position was committed (LLaDA2 returns such a canvas, as its reference)."""


def warn_masked(tokens: Tensor, prompt_length: int, answer: list[int], mask_id: int, sampler: str) -> None:
    """One check per run (not per forward): name the answer positions that still hold `mask_id` and why."""
    for row, length in enumerate(answer):
        span = tokens[row, prompt_length:prompt_length + length]
        where = (span == mask_id).nonzero().flatten().tolist()
        if where:
            warnings.warn(f"sampler={sampler!r}: the answer (row {row}, {length} tokens) still holds the mask id "
                          f"{mask_id} at answer positions {_short(where)}: the model sampled the mask token, or the "
                          "block's steps ran out first (their `trajectory.commit_step` is -2: never committed, or "
                          "the step that committed the mask id). Raise steps or check the model.",
                          MaskedAnswerWarning, stacklevel=5)


def optional(value: Any, check: Callable[[Any], Any]) -> Any:
    return None if value is None else check(value)


def filters(top_p: Any, top_k: Any) -> dict[str, Any]:
    """Dream's and the ARM's top-p / top-k filters (None: off)."""
    return dict(top_p=optional(top_p, lambda v: validate.number(v, name="top_p", min=0, max=1, min_open=True,
                                                                error=SamplerConfigError)),
                top_k=optional(top_k, lambda v: validate.integer(v, name="top_k", min=1, error=SamplerConfigError)))


def warn_idle(idle: list[int] | None, steps: int, gen_length: int) -> None:
    """steps > gen_length runs as in the reference, with a warning that names the steps that commit nothing
    (`idle`: those steps, None when not known in advance, e.g. Dream's random `origin` order)."""
    if steps <= gen_length:
        return
    which = ("some steps commit nothing (origin unmasks at random)" if idle is None
             else f"steps {_short(idle)} commit no token")
    warnings.warn(f"steps={steps} > gen_length={gen_length}: {which}; they still run a forward pass and fire "
                  "their hooks. Use steps <= gen_length to avoid idle steps.", IdleStepsWarning, stacklevel=4)


def _short(items: list[int]) -> str:
    return str(items) if len(items) <= 12 else f"{items[:8]}... ({len(items)} in all)"


def one_unpadded_row(sampler: str, ids: Tensor, am: Tensor, reason: str) -> None:
    """Refuse a prompt batch of more than one row, or a padded one, for a sampler whose canvas is one row."""
    if ids.shape[0] != 1 or not bool(am.all()):
        raise SamplerConfigError(f"sampler={sampler!r} decodes one unpadded prompt at a time ({reason}); got a "
                                 f"{tuple(ids.shape)} batch{' with padding' if not bool(am.all()) else ''}.",
                                 argument="prompt", value=tuple(ids.shape), allowed="a [1, pos] prompt without padding")


def prompt_tokens(model: Any, prompt: Any, attention_mask: Any) -> tuple[Tensor, Tensor]:
    """The prompt as `[batch, pos]` ids and a left-padded 0/1 attention mask, checked."""
    text = isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str))
    if text:
        if isinstance(prompt, str) and not prompt:
            raise InputError("prompt='' is empty; give at least one token.", argument="prompt", value=prompt,
                             allowed="a non-empty text or token ids")
        if attention_mask is not None:
            raise InputError("attention_mask is built by the tokenizer for text prompts; pass token ids to give "
                             "your own.", argument="attention_mask", value=attention_mask, allowed="None")
        ids, am = model.to_tokens(prompt, return_attention_mask=True)
        _warn_unknown(model, ids, am)
    else:
        if isinstance(prompt, (list, tuple)) and len(prompt) == 0:
            raise InputError("prompt=[] is empty; give at least one token.", argument="prompt", value=prompt,
                             allowed="a non-empty text or token ids")
        if isinstance(prompt, (list, tuple)) and not isinstance(prompt, Tensor):
            try:
                prompt = torch.as_tensor(prompt)
            except (TypeError, ValueError) as err:
                if all(isinstance(r, Tensor) for r in prompt):  # the list form generate_final takes
                    raise ArgumentTypeError(
                        "prompt is a list of tensors: stack them into one [batch, pos] tensor (left-padded, with "
                        "attention_mask marking the pads), or generate each prompt alone.", argument="prompt",
                        value=prompt, allowed="one [batch, pos] tensor, a list of int rows, or text") from None
                lengths = [len(r) for r in prompt if isinstance(r, (list, tuple))]
                if len(lengths) == len(prompt) and len(set(lengths)) > 1:  # the natural "two prompts" call
                    raise ArgumentTypeError(
                        f"prompt's rows have different lengths {lengths}: a batch is one [batch, pos] tensor, "
                        "left-padded, with attention_mask marking the pads (e.g. tokens, mask = "
                        "model.to_tokens(texts, padding_side='left', return_attention_mask=True)), or generate "
                        "each prompt alone.", argument="prompt", value=prompt,
                        allowed="rows of one length (left-padded, with attention_mask)") from None
                raise ArgumentTypeError(f"prompt must be text or token ids [batch, pos] ({err}).", argument="prompt",
                                        value=prompt, allowed="str, list of str, or int token ids") from None
        ids = validate.tensor(prompt, name="prompt", ndim=(1, 2), dtype="int", nonempty=False)
        ids = (ids[None] if ids.ndim == 1 else ids).to(model.input_device)
        if attention_mask is None:
            am = torch.ones_like(ids)
        else:
            am = validate.tensor(attention_mask, name="attention_mask", dtype=("int", "bool"), nonempty=False)
            am = am[None] if am.ndim == 1 else am
            validate.same_shape(ids, am, names=("prompt", "attention_mask"))
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"prompt of shape {tuple(ids.shape)} is empty; give at least one token per row.",
                         argument="prompt", value=ids, allowed="a [batch >= 1, pos >= 1] prompt")
    if attention_mask is None and not text:
        warn_leading_pads(ids, model.cfg)  # as the forward warns: leading pads would be attended
    return ids.long(), check_padding(am.to(ids.device).long())


def _warn_unknown(model: Any, ids: Tensor, am: Tensor) -> None:
    """A text prompt the tokenizer could not spell (unknown tokens) decodes a different prompt: say so."""
    from mdm_lens import tokenization

    unknown = tokenization.unknown_token_ids(model.tokenizer)
    if not unknown:
        return
    hit = (sum(ids == u for u in unknown).bool() & am.bool()).sum(-1).tolist()
    if any(hit):
        warnings.warn(f"the text prompt has tokens this tokenizer cannot spell: {hit} unknown token(s) per row; the "
                      "model sees <unk> there. Check the text (or pass token ids).", UserWarning, stacklevel=5)


def check_padding(am: Tensor) -> Tensor:
    """0/1 values, at least one real token per row, padding on the left only (the canvas follows the prompt)."""
    if bool(((am != 0) & (am != 1)).any()):
        raise InputError("attention_mask must hold 0 (pad) and 1 (token) only.", argument="attention_mask", value=am,
                         allowed="values in {0, 1}")
    empty = (am.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask rows {empty} are all zero: those prompts have no token.",
                         argument="attention_mask", value=am, allowed="at least one 1 per row")
    not_left = (am[:, 1:] < am[:, :-1]).any(-1).nonzero().flatten().tolist()
    if not_left:
        raise InputError(f"prompt rows {not_left} are not left-padded (a pad follows a token). The canvas is "
                         "appended after the prompt, so pad on the left: model.to_tokens(..., padding_side='left').",
                         argument="attention_mask", value=am, allowed="left padding (zeros, then ones)")
    return am
