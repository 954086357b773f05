"""Read-only weight views: tensors whose in-place writes raise `ReadOnlyViewError`.

TransformerLens users edit weights through their views (`model.blocks[0].attn.W_Q[0] *= 0`). Where a view is a
real view of a parameter the write goes through; where it cannot be one (layers stacked into a new tensor by
`torch.stack`, GQA key/value heads repeated for each query head, a zero bias the checkpoint does not have), the
write would land in a temporary copy and be lost. Such tensors are returned as `ReadOnlyView`: reading,
indexing and arithmetic behave as on any tensor; any in-place op (a method ending in `_`, a functional op with
`inplace=True` such as `F.relu(view, inplace=True)`), `__setitem__` or `out=` write into it (or into
an alias of it, e.g. `model.W_Q[0, 0] += 1`) raises with the reason and the view that does write through.
Results that do not share its storage are plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mdm_lens.errors import ReadOnlyViewError

#: in-place tensor methods that do not change values (allowed)
_HARMLESS = frozenset({"requires_grad_", "retain_grad", "share_memory_", "pin_memory_"})


def _is_write(func: Any, kwargs: dict) -> bool:
    """Whether `func` writes into its first argument: an in-place dunder (`__iadd__`, `__setitem__`), any torch
    function or method whose name ends with `_` (`relu_`, `copy_`, `dropout_`), or a functional op asked to work
    in place (`F.relu(x, inplace=True)` reaches `__torch_function__` as `relu` with `inplace` in kwargs)."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__",
                                                                                                  "__invert__", "__iter__")):
        return True
    if name.endswith("_") and not name.startswith("__") and name not in _HARMLESS:
        return True
    return kwargs.get("inplace") is True


def _written_view(func: Any, args: tuple, kwargs: dict) -> "ReadOnlyView | None":
    """The read-only view `func` would write into: its first argument for an in-place op, or any `out=` tensor
    (`torch.add(a, b, out=view)` writes into `view` whatever the first argument is)."""
    out = kwargs.get("out")
    for target in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(target, ReadOnlyView):
            return target
    if args and isinstance(args[0], ReadOnlyView) and _is_write(func, kwargs):
        return args[0]
    return None


class ReadOnlyView(Tensor):
    """A tensor that refuses in-place writes (see the module docstring); `reason` says what to write instead."""

    reason: str = "this tensor is a copy of the model's weights"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        mine = [a for a in args if isinstance(a, ReadOnlyView)]
        written = _written_view(func, args, kwargs)
        if written is not None:
            raise ReadOnlyViewError(f"in-place {getattr(func, '__name__', func)} on a read-only weight view: "
                                    f"{written.reason}")
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(*args, **kwargs)
            except (IndexError, TypeError) as e:
                if func is not Tensor.__getitem__:
                    raise
                raise _index_error(args, e) from None
        return _rewrap(out, mine)


def _index_error(args: tuple, err: Exception) -> Exception:
    """Indexing a weight view (`model.W_Q[9]`, `model.OV[0, 9]`) past its axes, or with a non-index: a typed error
    naming the index and the view's shape (its axes follow TL's order, e.g. [layer, head, ...])."""
    from mdm_lens.errors import InputTypeError, OutOfRangeError

    view, index = args[0], args[1] if len(args) > 1 else None
    shape = tuple(view.shape)
    if isinstance(err, IndexError):
        return OutOfRangeError(f"index {index!r} is out of range for a weight view of shape {shape} (axes in "
                               f"TransformerLens order, e.g. [layer, head, ...]; negative values count from the end): "
                               f"{err}", argument="index", value=index, allowed=f"indices within {shape}")
    return InputTypeError(f"index {index!r} is not a tensor index (ints, slices, lists or index tensors) for a weight "
                          f"view of shape {shape}.", argument="index", value=index, allowed="ints, slices, tensors")


def _storage(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _rewrap(out: Any, bases: list[ReadOnlyView]) -> Any:
    """Aliases of a read-only view stay read-only (a write into them would be lost just the same)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap(o, bases) for o in out)
    if not isinstance(out, Tensor) or not bases:
        return out
    ptr = _storage(out)
    for base in bases:
        if ptr is not None and ptr == _storage(base):
            return read_only(out, base.reason)
    return out.as_subclass(Tensor) if isinstance(out, ReadOnlyView) else out


def read_only(t: Tensor, reason: str) -> ReadOnlyView:
    """`t` as a `ReadOnlyView` whose write errors say `reason` (what the tensor is and what to edit instead)."""
    view = t.as_subclass(ReadOnlyView)
    view.reason = reason
    return view
