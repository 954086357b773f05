"""Shared base for probe results: a dataclass mixin whose ``.to_frame()`` gives a tidy table.

Every probe returns a dataclass whose tensor fields share a (possibly empty) *leading* shape
(e.g. ``[batch, layer, head]``, whatever the caller passed in) followed by field-specific
*trailing* axes (``key``, ``step``, ``region`` ...).  Subclasses declare the trailing axes of
each reported field in ``_dims``; ``to_frame`` melts every such field into long format:

    metric | <leading dims> | <trailing dims> | value | label [| reason]

one row per scalar (a ``reason`` column, empty where the value is defined, for results whose NaN values have
several causes: those define ``_reason``).  Numeric values go to ``value``; string values (labels) to ``label``.
The leading axes are unnamed at compute time (the probes are shape-generic), so their names
are supplied at ``to_frame(lead_dims=("batch", "layer"))``; unnamed ones become ``dim0, dim1, ...``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import numpy as np
import pandas as pd
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

__all__ = ["ResultMixin", "to_numpy"]


def _names(value: Any, allowed: list[str] | None, name: str) -> list[str]:
    """A list of str (``allowed``: each one of them); a lone str is refused (write [name])."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name}={value!r} is invalid: expected a list of str" +
                                (f" from {allowed}" if allowed else "") + ".", argument=name, value=value,
                                allowed="a list of str")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise ArgumentTypeError(f"{name}[{i}]={v!r} is invalid: expected a str.", argument=f"{name}[{i}]",
                                    value=v, allowed="str")
        out.append(v if allowed is None else validate.choice(v, allowed, name=f"{name}[{i}]"))
    return out


def to_numpy(x: Any) -> np.ndarray:
    """Tensor / array / scalar / list -> numpy array (detached, on CPU)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class ResultMixin:
    """Mixin for probe-result dataclasses.

    Subclasses set ``_dims = {"field": ("trailing", "axes")}``; a field with ``()`` is per
    leading element (e.g. a scalar summary per series).  ``_coords`` may map a trailing axis
    name to labels (e.g. region names) used instead of integer positions.
    """

    _dims: ClassVar[dict[str, tuple[str, ...]]] = {}

    def _coords(self) -> dict[str, Sequence[Any]]:
        return {}

    #: ``_reason(name, values) -> (values, reasons)``: the field's values as the table shows them and, per value,
    #: why it is NaN ("" where defined); None: the table has no reason column
    _reason: ClassVar[Any] = None

    def to_frame(self, lead_dims: Sequence[str] | None = None, metrics: Sequence[str] | None = None) -> pd.DataFrame:
        """Long-format DataFrame with one row per scalar of every reported field."""
        coords = self._coords()
        frames = []
        names = list(self._dims) if metrics is None else _names(metrics, list(self._dims), "metrics")
        if lead_dims is not None:
            _names(lead_dims, None, "lead_dims")
        for name in names:
            value = getattr(self, name)
            if value is None:
                continue
            arr = to_numpy(value)
            trailing = self._dims[name]
            n_lead = arr.ndim - len(trailing)
            if n_lead < 0:
                raise ArgumentError(f"field {name!r} has fewer axes than its declared trailing dims {trailing}")
            given = list(lead_dims or [])[:n_lead]
            lead = given + [f"dim{i}" for i in range(len(given), n_lead)]
            axes = lead + list(trailing)
            cols: dict[str, Any] = {"metric": np.full(arr.size, name, dtype=object)}
            grids = np.indices(arr.shape).reshape(arr.ndim, -1) if arr.ndim else np.zeros((0, 1), int)
            for ax, axis_name in enumerate(axes):
                idx = grids[ax]
                labels = coords.get(axis_name)
                cols[axis_name] = np.asarray(labels, dtype=object)[idx] if labels is not None else idx
            reasons = None
            if self._reason is not None:
                arr, reasons = self._reason(name, arr)
            flat = arr.reshape(-1)
            if reasons is not None:
                cols["reason"] = np.asarray(reasons, dtype=object).reshape(-1)
            if flat.dtype.kind in "USO":
                cols["value"] = np.full(flat.size, np.nan)
                cols["label"] = flat.astype(object)
            else:
                cols["value"] = flat.astype(float)
                cols["label"] = np.full(flat.size, None, dtype=object)
            frames.append(pd.DataFrame(cols))
        if not frames:
            return pd.DataFrame(columns=["metric", "value", "label"])
        df = pd.concat(frames, ignore_index=True, sort=False)
        tail = ["value", "label"] + (["reason"] if self._reason is not None else [])
        front = ["metric"] + [c for c in df.columns if c not in ("metric", *tail)]
        return df[front + tail]

    def summary(self) -> dict[str, Any]:
        """Plain-python dict of all dataclass fields (tensors converted to numpy)."""
        assert dataclasses.is_dataclass(self)
        return {f.name: (to_numpy(v) if isinstance(v, torch.Tensor) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
