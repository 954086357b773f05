"""Scores of a probe's predictions, with sklearn's argument names and order (``y_true`` first) -- and keyword-only,
because ``auc(scores, labels)`` (this module's old order) and ``auc(labels, scores)`` would both pass the checks
when the labels are float 0/1 and give different numbers. A positional call is refused with a typed error.

    auc(y_true=labels, y_score=scores)      # ROC AUC (Mann-Whitney, ties 1/2); NaN with one class
    r2(y_true=target, y_pred=prediction)    # 1 - SS_res / SS_tot; NaN for a constant target
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError

__all__ = ["auc", "r2"]


def _no_positional(fn: str, args: tuple, names: str) -> None:
    if args:
        raise ArgumentTypeError(f"{fn}() takes keyword arguments only ({names}): got {len(args)} positional "
                                f"argument(s). Write {fn}({names}); the order of a positional call is too easy to "
                                "swap silently.", argument="args", value=len(args), allowed=names)


def _auc_weighted(scores: Tensor, positive: Tensor, w: Tensor) -> Tensor:
    """Mann-Whitney AUC with mid-ranks for ties, each sample counted `w[b, i]` times: `[B]`, NaN without both
    classes. U = (sum of the positives' mid-ranks) - P(P+1)/2, AUC = U / (P N)."""
    uniq, inv = torch.unique(scores, return_inverse=True)
    at = w.new_zeros(w.shape[0], len(uniq)).index_add_(1, inv, w)                 # copies at each distinct score
    at_pos = w.new_zeros(w.shape[0], len(uniq)).index_add_(1, inv, w * positive)
    midrank = at.cumsum(1) - at + (at + 1) / 2
    n_pos = at_pos.sum(1)
    n_neg = at.sum(1) - n_pos
    u = (at_pos * midrank).sum(1) - n_pos * (n_pos + 1) / 2
    ok = (n_pos > 0) & (n_neg > 0)
    return torch.where(ok, u / (n_pos * n_neg).clamp_min(1), torch.full_like(u, float("nan")))


def _r2_weighted(y: Tensor, pred: Tensor, w: Tensor) -> Tensor:
    """1 - SS_res / SS_tot per weight row, NaN where the (weighted) target is constant."""
    total = w.sum(1)
    mean = (w * y).sum(1) / total
    ss_tot = (w * (y - mean[:, None]) ** 2).sum(1)
    ss_res = (w * (y - pred) ** 2).sum(1)
    used = w > 0
    lo = torch.where(used, y, torch.full_like(w, float("inf"))).amin(1)
    hi = torch.where(used, y, torch.full_like(w, float("-inf"))).amax(1)
    return torch.where(hi > lo, 1 - ss_res / ss_tot.clamp_min(1e-300), torch.full_like(total, float("nan")))


def auc(*args: Any, y_true: Tensor | None = None, y_score: Float[Tensor, "n"] | None = None) -> float:
    """ROC AUC of `y_score` for binary `y_true` (bool or 0/1) by the Mann-Whitney rank formula, ties counted 1/2
    (sklearn's ``roc_auc_score(y_true, y_score)``, keyword-only here). NaN when only one class is present."""
    _no_positional("auc", args, "y_true=..., y_score=...")
    scores = validate.tensor(y_score, name="y_score", ndim=1, dtype="float", finite=True)
    labels = validate.tensor(y_true, name="y_true", shape=(len(scores),), dtype=("int", "bool"))
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise InputError("y_true must be 0/1 or bool.", argument="y_true", value=labels, allowed="0/1")
    w = torch.ones(1, len(scores), dtype=torch.float64)
    return float(_auc_weighted(scores.double(), labels.double(), w)[0])


def r2(*args: Any, y_true: Float[Tensor, "n"] | None = None, y_pred: Float[Tensor, "n"] | None = None) -> float:
    """Coefficient of determination with the mean of `y_true` (sklearn's ``r2_score(y_true, y_pred)``,
    keyword-only here); NaN when `y_true` is constant."""
    _no_positional("r2", args, "y_true=..., y_pred=...")
    y_true = validate.tensor(y_true, name="y_true", ndim=1, dtype=("float", "int"), finite=True)
    y_pred = validate.tensor(y_pred, name="y_pred", shape=(len(y_true),), dtype="float", finite=True)
    return float(_r2_weighted(y_true.double(), y_pred.double(), torch.ones(1, len(y_true), dtype=torch.float64))[0])
