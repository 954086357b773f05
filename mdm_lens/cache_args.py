"""Argument checks for the `ActivationCache` helpers `MDMActivationCache` wraps.

TL's helpers trust their arguments: ``decompose_resid(mode="attention")`` treats every unknown mode as "all"
(attention + MLP components returned for a typo of "attn"), ``pos_slice=99`` on 8 positions is a bare
``IndexError`` from deep in TL, ``pos_slice="a"`` a bare ``ValueError``, and ``apply_ln=1`` passes as truthy.
Here every argument is checked against the cached run before TL sees it: flags are bools, ``mode`` is one of
TL's three, and each ``*_slice`` is one of TL's slice inputs whose indices lie inside the axis it slices.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor
from transformer_lens.utilities.slice import Slice

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, OutOfRangeError

__all__ = ["bind", "check_slice", "check_token_shapes", "FLAGS", "MODES"]

#: boolean switches of TL's helpers (a truthy 1 or "no" is refused, not read as True)
FLAGS = ("incl_mid", "apply_ln", "mlp_input", "return_labels", "incl_embeds", "incl_remainder", "expand_neurons",
         "has_batch_dim", "recompute_ln")
#: `decompose_resid`'s modes (TL silently treats any other value as "all")
MODES = ("all", "mlp", "attn")
_SLICE_FORMS = "None, an int, a (start, stop[, step]) tuple, a slice, a list / 1-d int tensor of indices, or a Slice"


def bind(fn: Callable, helper: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """`fn`'s arguments by name (without ``self``); an unknown keyword or too many positionals is an
    `ArgumentError` naming the nearest accepted keyword."""
    sig = inspect.signature(fn)
    names = [p for p in sig.parameters if p != "self"]
    validate.keywords(kwargs, names, where=helper)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as e:
        raise ArgumentTypeError(f"{helper}(): {e}. Accepted: {', '.join(names)}.", argument=helper, value=args,
                                allowed=", ".join(names)) from None
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def check_common(arguments: dict[str, Any], helper: str, sizes: dict[str, int | None]) -> None:
    """Flags, `mode` and every ``*_slice`` of one helper call; `sizes` maps a slice's name to its axis length
    (None: the cache has no tensor to size it by, so only the form is checked)."""
    for name, value in arguments.items():
        if name in FLAGS:
            validate.boolean(value, name=name)
        elif name == "mode":
            validate.choice(value, MODES, name="mode")
        elif name.endswith("_slice"):
            check_slice(value, sizes.get(name), name=name, helper=helper)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (numbers.Integral, np.integer)):
        return int(value)
    if isinstance(value, Tensor) and value.ndim == 0 and not value.is_floating_point() and value.dtype != torch.bool:
        return int(value)
    return None


def check_slice(value: Any, size: int | None, *, name: str, helper: str) -> None:
    """One TL slice input checked against an axis of `size` items: ints in [-size, size), slice bounds in
    [-size, size] selecting at least one item, index lists of ints in range. Raises `ArgumentTypeError` for a
    form TL does not take and `OutOfRangeError` for an index outside the axis."""
    if isinstance(value, Slice):
        value = value.slice if value.mode != "identity" else None
    if value is None:
        return
    where = f"{helper}({name}={validate.describe(value)})"
    if _int(value) is not None:
        if size is not None:
            validate.index(_int(value), size, name=name, what=f"{name} index ({helper})")
        return
    if isinstance(value, (tuple, slice)):
        _check_range(value, size, name, where)
        return
    if isinstance(value, (list, Tensor, np.ndarray)):
        arr = np.asarray(value.cpu() if isinstance(value, Tensor) else value)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{where} is invalid: an index list must be a 1-d list of ints.",
                                    argument=name, value=value, allowed=_SLICE_FORMS)
        if size is not None:
            validate.indices([int(v) for v in arr], size, name=name, what=f"{name} index ({helper})", unique=False)
        return
    raise ArgumentTypeError(f"{where} is invalid: expected {_SLICE_FORMS}.", argument=name, value=value,
                            allowed=_SLICE_FORMS)


def _check_range(value: tuple | slice, size: int | None, name: str, where: str) -> None:
    parts = (value.start, value.stop, value.step) if isinstance(value, slice) else tuple(value)
    if not 1 <= len(parts) <= 3 or any(p is not None and _int(p) is None for p in parts):
        raise ArgumentTypeError(f"{where} is invalid: a range is (stop,), (start, stop) or (start, stop, step) of "
                                "ints or None, as in Python's slice().", argument=name, value=value,
                                allowed="(start, stop[, step]) of ints")
    sl = slice(*[None if p is None else _int(p) for p in parts])
    if sl.step is not None and sl.step <= 0:  # TL slices with a positive step only (its own ValueError otherwise)
        raise ArgumentError(f"{where} is invalid: the step is {sl.step}; TransformerLens slices take a positive step "
                            "(reverse the result instead).", argument=name, value=value, allowed="a step >= 1")
    if size is None:
        return
    for bound in (sl.start, sl.stop):
        if bound is not None and not -size <= bound <= size:
            raise OutOfRangeError(f"{where} is out of range: its bounds must lie in [-{size}, {size}] for an axis "
                                  f"of {size} (Python would silently cut the range).", argument=name, value=value,
                                  allowed=f"bounds in [-{size}, {size}]")
    if not range(size)[sl]:
        raise OutOfRangeError(f"{where} selects nothing of the {size} items on its axis.", argument=name,
                              value=value, allowed=f"a range selecting at least one of {size}")


def _token_shape(tokens: Any, name: str) -> tuple[int, ...]:
    if isinstance(tokens, str) or _int(tokens) is not None:
        return ()
    if isinstance(tokens, Tensor):
        return tuple(tokens.shape)
    raise ArgumentTypeError(f"{name}={validate.describe(tokens)} is invalid: expected a str, an int or an integer "
                            "tensor of ids (torch.tensor(ids) for a list).", argument=name, value=tokens,
                            allowed="str, int or an integer tensor")


def check_token_shapes(tokens: Any, incorrect_tokens: Any) -> None:
    """`logit_attrs`' ids: each a str, an int or a tensor, and `incorrect_tokens` shaped like `tokens` (each
    correct id is paired with one incorrect id; TL raises a bare ``ValueError``)."""
    shape = _token_shape(tokens, "tokens")
    if incorrect_tokens is None:
        return
    other = _token_shape(incorrect_tokens, "incorrect_tokens")
    if other != shape:
        raise ArgumentError(f"logit_attrs: incorrect_tokens has shape {other} but tokens has shape {shape}; each "
                            "correct id is paired with one incorrect id, so the shapes must match.",
                            argument="incorrect_tokens", value=incorrect_tokens, allowed=f"shape {shape}")
