"""Interactive views (circuitsvis) for notebooks; their offline HTML is :mod:`mdm_lens.views.circuits_html`.

    from mdm_lens import steps
    out = model.generate(prompt, cache="blocks.3.attn.hook_pattern" @ steps(0, -1))
    attention(out, step=0, layer=3)             # renders inline in Jupyter (a circuitsvis object)
    html = to_html(attention(out, 0, 3))        # a self-contained page that renders with no network

The notes on how circuitsvis renders offline, and what `to_html` does, are in circuits_html.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError, NonFiniteError
# the offline-HTML half and the token-label helpers live in circuits_html; re-exported here as before
from mdm_lens.views.circuits_html import (BUNDLE_MARKER, EMPTY_LABEL, ZWSP, OfflineView, Renderer,  # noqa: F401
                                          _display, _plain, _visible, bundle_available, bundle_script, offline,
                                          parse_view, to_html)

__all__ = ["attention", "attention_from_pattern", "tokens_by_persistence", "step_str_tokens", "to_html",
           "offline", "OfflineView", "bundle_available", "bundle_script", "parse_view", "BUNDLE_MARKER"]


def _cv():
    import circuitsvis as cv  # imported lazily: only the interactive views need it

    return cv


def _np(x: Any, name: str = "array") -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as err:  # None, a str, a ragged list: name the argument
        raise ArgumentTypeError(f"{name}={validate.describe(x)} is not an array of numbers ({err}).", argument=name,
                                value=x, allowed="a tensor, ndarray or nested list of numbers") from None


# --- building views ----------------------------------------------------------------------------------
def step_str_tokens(out: Any, step: int, model: Any = None, batch: int = 0, length: int | None = None) -> list[str]:
    """Token labels of the model input at `step` (`out.trajectory.x_steps[step, batch]`). Mask tokens are
    shown as `[MASK]`, left padding as `[PAD]`. Without a tokenizer the labels are `str(id)`."""
    n = out.n_steps
    s = _resolve_step(step, n)
    x = out.trajectory.x_steps[s]
    batch = validate.index(batch, x.shape[0], name="batch", what="batch row")
    ids = x[batch]
    trace = getattr(out.trajectory, "length", None)
    if trace is not None:  # a variable-length run: that step's own canvas, without the -1 columns past its width
        ids = ids[:int(trace.widths[s])]
    if length is not None:
        ids = ids[:validate.integer(length, name="length", min=1, max=x.shape[1])]
    ids = [int(i) for i in ids]
    model = model if model is not None else getattr(getattr(out, "cache", None), "model", None)
    mask_id = getattr(getattr(model, "cfg", None), "mask_token_id", None)
    am = getattr(out, "attention_mask", None)
    # variable-length runs decode one unpadded row: the final attention mask says nothing of another step's columns
    pad = [False] * len(ids)
    if am is not None and trace is None:
        pad = [not bool(v) for v in am[batch, :len(ids)].tolist()]
    pad += [False] * (len(ids) - len(pad))
    tok = getattr(model, "tokenizer", None)
    labels: list[str] = []
    if tok is not None:
        valid = [i for i in ids if i >= 0]
        strs = iter(model.to_str_tokens(valid) if valid else [])
        for i in ids:
            labels.append(next(strs) if i >= 0 else "[·]")
    else:
        labels = ["[MASK]" if (mask_id is not None and i == mask_id) else ("[·]" if i < 0 else str(i)) for i in ids]
    return ["[PAD]" if p else lab for lab, p in zip(labels, pad)]


def _resolve_step(step: int, n_steps: int) -> int:
    """A step of the run (negatives count from the end); `OutOfRangeError` names the valid range."""
    return validate.index(step, n_steps, name="step", what="step")


def attention(out: Any, step: int, layer: int, model: Any = None, batch: int = 0,
              heads: Sequence[int] | None = None, kind: Literal["patterns", "heads"] = "patterns") -> Any:
    """circuitsvis view of layer `layer`'s attention pattern at denoising step `step` (negative steps
    count from the end of the run) for one batch row. The labels come from that step's input, so
    still-masked positions read `[MASK]`. The pattern must be in `out.cache`; if it is not, rerun with
    `cache="blocks.{layer}.attn.hook_pattern" @ steps(step)`. Steps, layers (negatives count from the end
    when the model is known), batch rows and heads out of range raise `OutOfRangeError`."""
    validate.choice(kind, ("patterns", "heads"), name="kind")
    n = out.n_steps
    s = _resolve_step(step, n)
    owner = model if model is not None else getattr(getattr(out, "cache", None), "model", None)
    n_layers = getattr(getattr(owner, "cfg", None), "n_layers", None)
    layer = (validate.index(layer, n_layers, name="layer", what="layer") if n_layers is not None
             else validate.integer(layer, name="layer", min=0))
    name = f"blocks.{layer}.attn.hook_pattern"
    how = (f'rerun generate with cache="{name}" @ steps({step}) (`from mdm_lens import steps`), or add '
           f'"{name}" to the cached names')
    cache = getattr(out, "cache", None)
    if cache is None:
        raise InputError(f"this run has no trajectory cache, so there is no attention pattern to show; {how}.")
    cached_names = list(getattr(cache, "names", []) or [])
    if cached_names and name not in cached_names:
        raise InputError(f"{name!r} was not cached (cached: {cached_names}); {how}.")
    if s not in cache.steps:
        raise InputError(f"step {s} was not cached (cached steps: {cache.steps}); {how}.")
    try:
        pattern = cache[s][name]
    except KeyError:
        raise InputError(f"{name!r} is not in the cache of step {s}; {how}.") from None
    batch = validate.index(batch, pattern.shape[0], name="batch", what="batch row")
    pattern = pattern[batch]                                    # [head, query, key]
    if heads is not None:
        heads = validate.indices(heads, pattern.shape[0], name="heads", what="head")
        pattern = pattern[heads]
    tokens = step_str_tokens(out, s, model=model, batch=batch, length=int(pattern.shape[-1]))
    head_names = [f"L{layer}H{h}" for h in (heads if heads is not None else range(pattern.shape[0]))]
    causal = bool(getattr(out, "causal", False))
    return attention_from_pattern(tokens, pattern, kind=kind, head_names=head_names, mask_upper_tri=causal)


def attention_from_pattern(str_tokens: Sequence[str], pattern: Any, kind: Literal["patterns", "heads"] = "patterns",
                           head_names: Sequence[str] | None = None, mask_upper_tri: bool = False) -> Any:
    """circuitsvis view of a `[head, query, key]` (or `[query, key]`) attention pattern. The default is
    `cv.attention.attention_patterns`. `kind="heads"` uses `attention_heads`, which adds head names and
    masks the upper triangle for causal models."""
    validate.choice(kind, ("patterns", "heads"), name="kind")
    p = _np(pattern, name="pattern")
    if p.ndim == 2:
        p = p[None]
    if p.ndim != 3:
        raise InputError(f"pattern must be [head, query, key], got shape {tuple(p.shape)}.", argument="pattern",
                         value=tuple(p.shape), allowed="[head, query, key] or [query, key]")
    if p.shape[1] != p.shape[2]:
        raise InputError(f"circuitsvis needs square patterns (query = key positions); got {tuple(p.shape)}.",
                         argument="pattern", value=tuple(p.shape), allowed="query = key")
    validate.finite(torch.from_numpy(p), name="pattern")
    tokens = _display(str_tokens)
    if len(tokens) != p.shape[-1]:
        raise InputError(f"{len(tokens)} token labels for a pattern over {p.shape[-1]} positions.",
                         argument="str_tokens", value=len(tokens), allowed=f"{p.shape[-1]} labels")
    if head_names is not None and len(head_names) != p.shape[0]:
        raise InputError(f"{len(head_names)} head names for {p.shape[0]} heads.", argument="head_names",
                         value=list(head_names), allowed=f"{p.shape[0]} names")
    cv = _cv()
    if kind == "heads":
        return cv.attention.attention_heads(attention=p, tokens=tokens,
                                            attention_head_names=list(head_names) if head_names else None,
                                            mask_upper_tri=mask_upper_tri)
    return cv.attention.attention_patterns(tokens=tokens, attention=p)


def tokens_by_persistence(str_tokens: Sequence[str], persistence: Any, max_value: float | None = None) -> Any:
    """Tokens coloured by anchor persistence: the fraction of steps, or of layers, at which each position
    was detected as an anchor. NaN counts as 0. The scale is 0 to 1, or 0 to the maximum if that is above 1."""
    raw = _np(persistence, name="persistence").ravel()
    if np.isinf(raw).any():
        raise NonFiniteError(f"persistence has {int(np.isinf(raw).sum())} inf values; expected fractions in [0, 1] "
                             "(NaN counts as 0).", argument="persistence", value=raw, allowed="finite values or NaN")
    v = np.nan_to_num(raw, nan=0.0)
    tokens = _display(str_tokens)
    if len(tokens) != v.size:
        raise InputError(f"{len(tokens)} tokens for {v.size} persistence values.", argument="str_tokens",
                         value=len(tokens), allowed=f"{v.size} labels")
    top = float(max_value) if max_value is not None else max(1.0, float(v.max()) if v.size else 1.0)
    return _cv().tokens.colored_tokens(tokens=tokens, values=v, min_value=0.0, max_value=top)


# --- offline HTML ------------------------------------------------------------------------------------
