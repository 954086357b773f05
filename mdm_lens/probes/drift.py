"""Anchor drift across denoising steps and fixed-sink vs floating labels (spec §3.4, §3.5).

Inputs are per-step series ``[..., step, key]`` of anchor sets (bool, from
:func:`mdm_lens.probes.floating.detect_anchors`) and received attention.  Everything here is also
importable from :mod:`mdm_lens.probes.floating`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

from . import _checks as C
from ._results import ResultMixin, to_numpy
from .received import absorption

__all__ = ["drift", "DriftResult", "anchor_types", "spearman", "ols_slope", "wasserstein1", "initial_absorption",
           "classify_layer", "LayerClassification", "ANCHOR_TYPES", "LAYER_LABELS"]

ANCHOR_TYPES: tuple[str, ...] = ("prompt", "committed", "just_committed", "masked")
LAYER_LABELS: tuple[str, ...] = ("fixed_initial", "fixed_anchor", "floating", "diffuse", "other")


# ----------------------------------------------------------------------------------------------
# series statistics
# ----------------------------------------------------------------------------------------------

def _ranks(x: Tensor, valid: Tensor) -> Tensor:
    """Average (tie-aware) ranks 1..n of x along the last axis among ``valid`` entries."""
    xi, xj = x[..., :, None], x[..., None, :]
    vj = valid[..., None, :]
    less = ((xj < xi) & vj).sum(-1).to(torch.float64)
    equal = ((xj == xi) & vj).sum(-1).to(torch.float64)
    return torch.where(valid, less + (equal + 1) / 2, torch.full_like(less, torch.nan))


def _pearson(x: Tensor, y: Tensor, valid: Tensor) -> Tensor:
    n = valid.sum(-1).to(torch.float64)
    zero = torch.zeros_like(x)
    xm = torch.where(valid, x, zero).sum(-1, keepdim=True) / n.clamp_min(1)[..., None]
    ym = torch.where(valid, y, zero).sum(-1, keepdim=True) / n.clamp_min(1)[..., None]
    dx, dy = torch.where(valid, x - xm, zero), torch.where(valid, y - ym, zero)
    sxy, sxx, syy = (dx * dy).sum(-1), (dx * dx).sum(-1), (dy * dy).sum(-1)
    ok = (n >= 2) & (sxx > 0) & (syy > 0)
    return torch.where(ok, sxy / (sxx * syy).clamp_min(1e-300).sqrt(), torch.full_like(sxy, torch.nan))


def _pair(x: Tensor, y: Tensor, policy: str) -> tuple[Tensor, Tensor, Tensor]:
    C.float_tensor(x, name="x")
    C.float_tensor(y, name="y")
    C.shapes_broadcast(x, y, names=("x", "y"))
    policy = C.nan_policy(policy)
    C.finite_where(x, None, name="x", policy=policy)
    C.finite_where(y, None, name="y", policy=policy)
    x, y = torch.broadcast_tensors(x.to(torch.float64), y.to(torch.float64))
    return x, y, torch.isfinite(x) & torch.isfinite(y)


def spearman(x: Float[Tensor, "... n"], y: Float[Tensor, "... n"], nan_policy: str = "raise") -> Float[Tensor, "..."]:
    """Spearman ρ = Pearson correlation of average ranks (ties share their mean rank).

    NaN with < 2 valid pairs or a constant series.  NaN/inf in x or y raises ``NonFiniteError``;
    ``nan_policy="omit"`` drops the pairs where either is non-finite (as :func:`drift` does for the
    centroid of steps without anchors).
    """
    x, y, valid = _pair(x, y, nan_policy)
    return _pearson(_ranks(x, valid), _ranks(y, valid), valid)


def ols_slope(x: Float[Tensor, "... n"], y: Float[Tensor, "... n"], nan_policy: str = "raise") -> Float[Tensor, "..."]:
    """OLS slope β = Σ(x−x̄)(y−ȳ)/Σ(x−x̄)²; NaN with < 2 pairs or constant x.  ``nan_policy`` as :func:`spearman`."""
    x, y, valid = _pair(x, y, nan_policy)
    n = valid.sum(-1, keepdim=True).clamp_min(1).to(torch.float64)
    zero = torch.zeros_like(x)
    dx = torch.where(valid, x - torch.where(valid, x, zero).sum(-1, keepdim=True) / n, zero)
    dy = torch.where(valid, y - torch.where(valid, y, zero).sum(-1, keepdim=True) / n, zero)
    sxx = (dx * dx).sum(-1)
    ok = (valid.sum(-1) >= 2) & (sxx > 0)
    return torch.where(ok, (dx * dy).sum(-1) / sxx.clamp_min(1e-300), torch.full_like(sxx, torch.nan))


def wasserstein1(p: Float[Tensor, "... key"], q: Float[Tensor, "... key"]) -> Float[Tensor, "..."]:
    """W1 between two mass profiles over positions 0..K−1 (unit spacing), each normalised to sum 1:
    W1 = Σ_j |CDF_p(j) − CDF_q(j)|  (in tokens).  NaN if either has zero mass.  Both must be finite, ≥ 0."""
    for name, t in (("p", p), ("q", q)):
        C.float_tensor(t, name=name)
        C.finite_where(t, None, name=name)
        if bool((t < 0).any()):
            raise ArgumentError(f"{name} has negative entries: a mass profile must be >= 0.", argument=name,
                                value=t, allowed="values >= 0")
    if p.shape[-1] != q.shape[-1]:
        raise ArgumentError(f"q has {q.shape[-1]} positions but p has {p.shape[-1]}.", argument="q", value=q,
                            allowed=f"shape [..., {p.shape[-1]}]")
    C.shapes_broadcast(p, q, names=("p", "q"))
    return _w1(p, q)


def _w1(p: Tensor, q: Tensor) -> Tensor:
    p, q = p.to(torch.float64), q.to(torch.float64)
    sp, sq = p.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
    w = (torch.cumsum(p / sp.clamp_min(1e-300), -1) - torch.cumsum(q / sq.clamp_min(1e-300), -1)).abs().sum(-1)
    ok = (sp > 0).squeeze(-1) & (sq > 0).squeeze(-1)
    return torch.where(ok, w, torch.full_like(w, torch.nan))


# ----------------------------------------------------------------------------------------------
# §3.4 drift
# ----------------------------------------------------------------------------------------------

@dataclass
class DriftResult(ResultMixin):
    """Anchor drift over steps for each series (leading shape ``...``).  See :func:`drift`.

    ``to_frame()`` columns: ``metric`` (a field name below), the leading dims, then ``key`` / ``step`` /
    ``pair`` (pair s = steps s and s+1) / ``type`` where the field has that axis, ``value``, ``label``, ``reason``
    (why ``value`` is NaN; a ``modal_anchor`` of −1, no anchor, is NaN there).
    """

    persistence: Tensor          # [..., key]     π_j = fraction of steps with j ∈ S_s
    modal_anchor: Tensor         # [...]          j* = argmax π_j (first of ties; −1 if never any anchor)
    stability: Tensor            # [...]          π_{j*} (NaN if never any anchor: no modal anchor)
    n_anchors: Tensor            # [..., step]    |S_s|
    empty_fraction: Tensor       # [...]          fraction of steps with S_s = ∅
    jaccard: Tensor              # [..., pair]    |S_s ∩ S_{s+1}| / |S_s ∪ S_{s+1}| (both empty: NaN, 0/0)
    mean_jaccard: Tensor         # [...]          J̄ over the defined pairs (NaN with one step or none defined)
    drift_index: Tensor          # [...]          1 − J̄
    n_distinct: Tensor           # [...]          U = |∪_s S_s|
    top1: Tensor                 # [..., step]    argmax_j r_j(s) over visible keys
    top1_change_rate: Tensor     # [...]          fraction of pairs whose top-1 differs (NaN with one step)
    centroid: Tensor             # [..., step]    mass-weighted mean position of S_s (NaN if empty)
    centroid_slope: Tensor       # [...]          OLS slope of c_s on s (tokens/step), over steps with anchors
    centroid_spearman: Tensor    # [...]          Spearman ρ(s, c_s), over steps with anchors
    w1: Tensor                   # [..., pair]    W1(r(s), r(s+1)) in tokens
    mean_w1: Tensor              # [...]
    anchor_types: Tensor | None  # [..., step, type] anchor counts by ANCHOR_TYPES (needs commit_step)
    lead_dims: tuple[str, ...] = ()  # names of the leading axes for to_frame (drift_from_output: batch, layer, head)

    def to_frame(self, lead_dims=None, metrics=None):
        return super().to_frame(lead_dims=lead_dims or self.lead_dims or None, metrics=metrics)

    _dims: ClassVar = {
        "persistence": ("key",), "modal_anchor": (), "stability": (), "n_anchors": ("step",),
        "empty_fraction": (), "jaccard": ("pair",), "mean_jaccard": (), "drift_index": (),
        "n_distinct": (), "top1": ("step",), "top1_change_rate": (), "centroid": ("step",),
        "centroid_slope": (), "centroid_spearman": (), "w1": ("pair",), "mean_w1": (),
        "anchor_types": ("step", "type")}

    def _coords(self):
        return {"type": ANCHOR_TYPES}

    def _reason(self, name: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Why each NaN of field `name` is undefined (the frame's ``reason`` column)."""
        n_steps = self.n_anchors.shape[-1]
        blind = to_numpy(self.persistence).astype(float)
        blind = np.isnan(blind).all(-1) if blind.shape[-1] else np.ones(blind.shape[:-1], bool)  # no visible key
        never = blind | (to_numpy(self.modal_anchor) < 0)
        n_def = (~np.isnan(to_numpy(self.centroid).astype(float))).sum(-1)
        one = "one step: no step pair" if n_steps < 2 else ""
        why = {"persistence": np.where(blind, "no visible key at any step", "")[..., None],
               "empty_fraction": np.where(blind, "no visible key at any step", ""),
               "stability": np.where(blind, "no visible key at any step", np.where(never, "no anchor at any step", "")),
               "jaccard": np.array("both anchor sets of the pair are empty (0/0)"),
               "mean_jaccard": np.array(one or "every step pair's anchor sets are empty (0/0)"),
               "top1_change_rate": np.array(one), "mean_w1": np.array(one or "no step pair has received mass"),
               "w1": np.array("a step of the pair has no received mass"),
               "centroid": np.array("no anchor at this step"),
               "centroid_slope": np.where(n_def < 2, "fewer than two steps with anchors", ""),
               "centroid_spearman": np.where(n_def < 2, "fewer than two steps with anchors",
                                             "constant centroid: no rank order")}
        why["drift_index"] = why["mean_jaccard"]
        why["modal_anchor"] = why["stability"]
        if name == "modal_anchor":
            values = np.where(never, np.nan, values.astype(float))
        nan = np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
        reasons = np.broadcast_to(why.get(name, np.array("")), values.shape) if name in why else np.full(values.shape, "")
        return values, np.where(nan, reasons, "").astype(object)


def _commit(commit_step: Tensor, n_keys: int, against: tuple[int, ...]) -> Tensor:
    C.int_tensor(commit_step, name="commit_step")
    if commit_step.shape[-1] != n_keys:
        raise ArgumentError(f"commit_step has {commit_step.shape[-1]} keys, expected {n_keys}.",
                            argument="commit_step", value=commit_step, allowed=f"shape [..., {n_keys}]")
    try:
        torch.broadcast_shapes(tuple(commit_step.shape[:-1]) + (1, n_keys), against)
    except RuntimeError:
        raise ArgumentError(f"commit_step of shape {tuple(commit_step.shape)} does not broadcast against the "
                            f"[..., step, key] series of shape {against}.", argument="commit_step",
                            value=commit_step, allowed="[..., key] matching the leading axes") from None
    if bool((commit_step < -1).any()):
        raise ArgumentError("commit_step holds values < -1: expected -1 (prompt) or a step index >= 0.",
                            argument="commit_step", value=commit_step, allowed=">= -1")
    return commit_step


def anchor_types(anchors: Bool[Tensor, "... step key"], commit_step: Int[Tensor, "... key"]) -> Int[Tensor, "... step type"]:
    """Count anchors at each step by token type (``ANCHOR_TYPES`` order).

    At step s the input x_s holds the tokens committed at steps < s.  For a key with commit step c:
    prompt: c < 0; committed: 0 ≤ c < s−1; just_committed: c = s−1; masked: c ≥ s (still [MASK]).
    """
    if not isinstance(anchors, Tensor) or anchors.dtype != torch.bool or anchors.ndim < 2:
        raise ArgumentTypeError(f"anchors={validate.describe(anchors)} is invalid: expected a bool [..., step, key] "
                                "tensor.", argument="anchors", value=anchors, allowed="bool [..., step, key]")
    _commit(commit_step, anchors.shape[-1], tuple(anchors.shape))
    return _anchor_types(anchors, commit_step)


def _anchor_types(anchors: Tensor, commit_step: Tensor) -> Tensor:
    n_steps = anchors.shape[-2]
    s = torch.arange(n_steps, device=anchors.device)[:, None]               # [step, 1]
    c = commit_step.long()[..., None, :]                                     # [..., 1, key]
    cats = torch.stack(torch.broadcast_tensors(c < 0, (c >= 0) & (c < s - 1), (c >= 0) & (c == s - 1), c >= s), -1)
    return (anchors[..., None] & cats).sum(-2)


def drift(anchors: Bool[Tensor, "... step key"], received: Float[Tensor, "... step key"],
          commit_step: Int[Tensor, "... key"] | None = None,
          key_visible: Bool[Tensor, "... key"] | None = None,
          step_visible: Bool[Tensor, "... step key"] | None = None, nan_policy: str = "raise") -> DriftResult:
    """Stability / turnover / position drift of the anchor sets S_s, s = 0..S−1 (§3.4).

    π_j = (1/S) Σ_s 1[j ∈ S_s]; J̄ = mean_s Jaccard(S_s, S_{s+1}); U = |∪ S_s|; top-1 change rate =
    fraction of s with argmax r(s) ≠ argmax r(s+1); centroid c_s = Σ_{j∈S_s} r_j j / Σ_{j∈S_s} r_j
    (unweighted mean if the anchors carry no mass; NaN if S_s = ∅) with its OLS slope and Spearman ρ
    against s over the steps that have anchors; W1 between consecutive r(s) over positions.

    Visibility: ``key_visible [..., key]`` (same at every step) and/or ``step_visible [..., step, key]``
    (e.g. ARM prefixes); invisible keys are never anchors and carry no mass.  NaN/inf received at a
    visible key raises ``NonFiniteError`` (``nan_policy="omit"``: such keys are invisible).  A series with no
    visible key at any step has NaN ``persistence`` / ``stability`` / ``empty_fraction`` (undefined, not 0).
    """
    received = C.float_tensor(received, name="received", min_ndim=2)
    if not isinstance(anchors, Tensor) or anchors.dtype != torch.bool:
        raise ArgumentTypeError(f"anchors={validate.describe(anchors)} is invalid: expected a bool tensor.",
                                argument="anchors", value=anchors, allowed="a bool tensor")
    shape = C.shapes_broadcast(received, anchors, names=("received", "anchors"))
    if shape != tuple(received.shape):
        raise ArgumentError(f"anchors of shape {tuple(anchors.shape)} must broadcast to received's shape "
                            f"{tuple(received.shape)}.", argument="anchors", value=anchors,
                            allowed=f"broadcastable to {tuple(received.shape)}")
    n_steps, n_keys = received.shape[-2:]
    key_visible = C.mask(key_visible, name="key_visible", size=n_keys,
                         against=received.shape[:-2] + (n_keys,))
    step_visible = C.mask(step_visible, name="step_visible", size=n_keys, against=received.shape)
    if commit_step is not None:
        _commit(commit_step, n_keys, tuple(received.shape))
    policy = C.nan_policy(nan_policy)
    vis = torch.ones_like(received, dtype=torch.bool)
    if key_visible is not None:
        vis = vis & key_visible[..., None, :]
    if step_visible is not None:
        vis = vis & step_visible
    C.finite_where(received, vis, name="received", policy=policy)
    vis = vis & torch.isfinite(received)
    r = torch.where(vis, received.to(torch.float64), torch.zeros((), dtype=torch.float64))
    a = anchors.expand(r.shape) & vis
    af = a.to(torch.float64)

    persistence = af.mean(-2)
    modal = persistence.argmax(-1)
    stability = persistence.amax(-1)
    modal = torch.where(stability > 0, modal, torch.full_like(modal, -1))
    n_anchors = a.sum(-1)
    # a series with no visible key at any step (an all-NaN record) has undefined anchor sets: its persistence,
    # stability and empty fraction are NaN, not 0, which would read as the finding "never an anchor"
    undefined = ~vis.any(-1).any(-1)
    nan = torch.full((), torch.nan, dtype=torch.float64)
    persistence = torch.where(undefined[..., None], nan, persistence)
    stability = torch.where(undefined | (modal < 0), nan, stability)  # no modal anchor: its share is undefined
    empty_fraction = torch.where(undefined, nan, (n_anchors == 0).to(torch.float64).mean(-1))

    inter = (a[..., 1:, :] & a[..., :-1, :]).sum(-1).to(torch.float64)
    union = (a[..., 1:, :] | a[..., :-1, :]).sum(-1).to(torch.float64)
    # two empty anchor sets are 0/0: no evidence of stability or of drift, so NaN (and left out of the mean)
    jac = torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(union, torch.nan))
    mean_jac = jac.nanmean(-1) if n_steps > 1 else torch.full(jac.shape[:-1], torch.nan, dtype=torch.float64)

    masked_r = torch.where(vis, r, torch.full_like(r, -torch.inf))
    top1 = masked_r.argmax(-1)
    change = (top1[..., 1:] != top1[..., :-1]).to(torch.float64)
    change_rate = change.mean(-1) if n_steps > 1 else torch.full(change.shape[:-1], torch.nan, dtype=torch.float64)

    pos = torch.arange(n_keys, dtype=torch.float64, device=r.device)
    w = r * af
    ws, cnt = w.sum(-1), af.sum(-1)
    weighted = (w * pos).sum(-1) / ws.clamp_min(1e-300)
    plain = (af * pos).sum(-1) / cnt.clamp_min(1)
    centroid = torch.where(ws > 0, weighted, torch.where(cnt > 0, plain, torch.full_like(plain, torch.nan)))
    steps = torch.arange(n_steps, dtype=torch.float64, device=r.device).expand(centroid.shape)

    w1 = _w1(r[..., :-1, :], r[..., 1:, :])
    return DriftResult(
        persistence=persistence, modal_anchor=modal, stability=stability, n_anchors=n_anchors,
        empty_fraction=empty_fraction,
        jaccard=jac, mean_jaccard=mean_jac, drift_index=1.0 - mean_jac,
        n_distinct=a.any(-2).sum(-1), top1=top1, top1_change_rate=change_rate,
        centroid=centroid, centroid_slope=ols_slope(steps, centroid, nan_policy="omit"),
        centroid_spearman=spearman(steps, centroid, nan_policy="omit"),
        w1=w1, mean_w1=w1.nanmean(-1) if n_steps > 1 else torch.full(w1.shape[:-1], torch.nan, dtype=torch.float64),
        anchor_types=None if commit_step is None else _anchor_types(a, commit_step))


# ----------------------------------------------------------------------------------------------
# §3.5 fixed sink vs floating
# ----------------------------------------------------------------------------------------------

def initial_absorption(received: Float[Tensor, "... step key"], key_visible: Bool[Tensor, "... key"] | None = None,
                       n_initial: int = 4, nan_policy: str = "raise") -> Float[Tensor, "..."]:
    """Absorb_{pos<n_initial} per step (percent of mass on the first n_initial visible keys, the
    StreamingLLM sink window), reduced by the (lower) median over steps."""
    received = C.float_tensor(received, name="received", min_ndim=2)
    key_visible = C.mask(key_visible, name="key_visible", size=received.shape[-1],
                         against=received.shape[:-2] + received.shape[-1:])
    n_initial = validate.integer(n_initial, name="n_initial", min=1)
    r = received.to(torch.float64)
    vis = torch.ones_like(r, dtype=torch.bool) if key_visible is None else key_visible[..., None, :].expand(r.shape)
    C.finite_where(r, vis, name="received", policy=C.nan_policy(nan_policy))
    vis = vis & torch.isfinite(r)
    rank = torch.cumsum(vis.long(), -1) - 1
    per_step = absorption(torch.where(vis, r, torch.zeros_like(r)), vis & (rank < n_initial))
    return per_step.median(-1).values


@dataclass
class LayerClassification(ResultMixin):
    """Per-series labels (``LAYER_LABELS``) with the quantities that decided them.

    ``to_frame()`` columns: ``metric`` (a field name), the leading dims, ``value`` (numbers), ``label``
    (for ``labels``).
    """

    labels: np.ndarray           # [...] str
    stability: Tensor
    modal_anchor: Tensor
    n_distinct: Tensor
    empty_fraction: Tensor
    initial_absorption: Tensor

    _dims: ClassVar = {"labels": (), "stability": (), "modal_anchor": (), "n_distinct": (),
                       "empty_fraction": (), "initial_absorption": ()}

    def distribution(self, axis: int = 0) -> np.ndarray:
        """Label counts along ``axis`` (samples): array [..., len(LAYER_LABELS)]."""
        axis = validate.index(axis, max(self.labels.ndim, 1), name="axis", what="axis")
        return np.stack([(self.labels == lab).sum(axis=axis) for lab in LAYER_LABELS], -1)

    def majority(self, axis: int = 0) -> np.ndarray:
        """Majority label along ``axis`` (ties broken by ``LAYER_LABELS`` order)."""
        return np.asarray(LAYER_LABELS, dtype=object)[self.distribution(axis).argmax(-1)]


def classify_layer(drift_result: DriftResult, initial_absorption: Float[Tensor, "..."], *,
                   persist: float = 0.9, n_initial: int = 4, initial_mass: float = 30.0,
                   diffuse_frac: float = 0.5) -> LayerClassification:
    """Label each series (one sample at one layer[/head]) per §3.5, first match wins:

    1. ``diffuse``:       no anchors at ≥ diffuse_frac (50%) of steps;
    2. ``fixed_initial``: π_{j*} ≥ 0.9, j* < 4 and Absorb_{pos<4} (median step, %) ≥ 30;
    3. ``fixed_anchor``:  π_{j*} ≥ 0.9 otherwise (j* ≥ 4, or an initial anchor without the mass);
    4. ``floating``:      π_{j*} < 0.9 and U ≥ 2;
    5. ``other``:         π_{j*} < 0.9 with a single intermittent anchor (U = 1) — not in §3.5.

    ``initial_absorption`` comes from :func:`initial_absorption` (percent).  Aggregate over samples
    with ``.majority(axis)`` / ``.distribution(axis)``.
    """
    if not isinstance(drift_result, DriftResult):
        raise ArgumentTypeError(f"drift_result={validate.describe(drift_result)} is invalid: expected a DriftResult "
                                "(from drift / drift_from_output).", argument="drift_result", value=drift_result,
                                allowed="DriftResult")
    persist = validate.number(persist, name="persist", min=0, max=1)
    n_initial = validate.integer(n_initial, name="n_initial", min=1)
    initial_mass = validate.number(initial_mass, name="initial_mass", min=0, max=100)
    diffuse_frac = validate.number(diffuse_frac, name="diffuse_frac", min=0, max=1)
    d = drift_result
    stab, modal = to_numpy(d.stability), to_numpy(d.modal_anchor)
    uniq, empty = to_numpy(d.n_distinct), to_numpy(d.empty_fraction)
    init_arr = to_numpy(initial_absorption).astype(float)
    try:
        init = np.broadcast_to(init_arr, stab.shape)
    except ValueError:
        raise ArgumentError(f"initial_absorption of shape {init_arr.shape} does not broadcast to the drift result's "
                            f"shape {stab.shape}.", argument="initial_absorption", value=initial_absorption,
                            allowed=f"shape {stab.shape}") from None
    if not np.isfinite(init).all():
        raise C.NonFiniteError("initial_absorption holds NaN/inf (a series with no mass); expected finite percents.",
                               argument="initial_absorption", value=initial_absorption, allowed="finite values")
    fixed = stab >= persist
    labels = np.select(
        [empty >= diffuse_frac,
         fixed & (modal >= 0) & (modal < n_initial) & (init >= initial_mass),
         fixed,
         (stab < persist) & (uniq >= 2)],
        ["diffuse", "fixed_initial", "fixed_anchor", "floating"], default="other").astype(object)
    return LayerClassification(labels=labels, stability=d.stability, modal_anchor=d.modal_anchor,
                               n_distinct=d.n_distinct, empty_fraction=d.empty_fraction,
                               initial_absorption=torch.as_tensor(np.array(init)))
