"""Floating tokens / attention sinks: received attention, anchor detection, absorption, drift.

Spec: ``shared/specs/probes_and_paper.md`` §1.a, §1.b, §3.1-§3.5.

Axis conventions (TransformerLens): attention patterns are ``[..., query, key]`` with rows summing
to 1 over the keys visible to that query; received attention is ``[..., key]``; per-step series are
``[..., step, key]`` (permute a sampler recording ``[step, batch, layer, head, key]`` with
``einops.rearrange(x, "s b l h k -> b l h s k")``).  Masks broadcast against the tensor they
accompany in the usual right-aligned way; use :func:`align_mask` to place a ``[batch, key]`` mask
against e.g. ``[step, batch, layer, head, key]``.

Visibility: key ``j`` is visible to query ``i`` iff ``key_visible[j]`` (False = padding) and, when
``causal``, ``j <= i``.  Invisible keys never receive attention here and are never anchors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._results import ResultMixin, to_numpy

__all__ = [
    "align_mask", "visibility_mask", "uniform_pattern", "received_attention", "uniform_received",
    "detect_anchors", "absorption", "uniform_null", "absorption_variants", "AbsorptionResult",
    "drift", "DriftResult", "anchor_types", "spearman", "ols_slope", "wasserstein1", "initial_absorption",
    "classify_layer", "LayerClassification", "ANCHOR_TYPES", "LAYER_LABELS", "RULES",
]

Kind = Literal["mass", "visibility", "cumulative"]
Rule = Literal["zscore", "paper_absorption", "paper_temporal", "paper_qk", "gu", "rulli", "topk"]
RULES: tuple[str, ...] = ("zscore", "paper_absorption", "paper_temporal", "paper_qk", "gu", "rulli", "topk")
# Rule-specific default thresholds (eps=None picks these).
_DEFAULT_EPS = {"zscore": 3.0, "paper_absorption": 3.0, "paper_temporal": 3.0, "paper_qk": 3.0,
                "gu": 0.3, "rulli": 3.0, "topk": 0.0}
_STD_ZERO = 1e-10  # Rule C's "std ~ 0 -> no sinks" guard (float64 received values)


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------

def align_mask(mask: Tensor, ndim: int, batch_dim: int | None = None) -> Tensor:
    """Insert singleton axes so ``mask [b0, ..., key]`` broadcasts against an ``ndim``-axis tensor.

    The mask's leading axes are placed starting at ``batch_dim`` of the target and its last axis at
    the target's last axis, e.g. ``[batch, key]`` against ``[step, batch, layer, head, key]`` with
    ``batch_dim=1`` becomes ``[1, batch, 1, 1, key]``.  ``batch_dim=None``: right-aligned (unchanged).
    """
    if batch_dim is None or mask.ndim == ndim:
        return mask
    lead = mask.shape[:-1]
    before = batch_dim
    after = ndim - 1 - batch_dim - len(lead)
    if after < 0:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit {ndim} axes at batch_dim={batch_dim}")
    return mask.reshape((1,) * before + tuple(lead) + (1,) * after + (mask.shape[-1],))


def visibility_mask(n_query: int, n_key: int, key_visible: Bool[Tensor, "... key"] | None = None,
                    causal: bool = False, device=None) -> Bool[Tensor, "... query key"]:
    """V[i, j] = key_visible[j] and (not causal or j <= i + n_key - n_query).

    The offset makes the last query see every key, as for a KV-cached suffix of queries.
    """
    if key_visible is not None:
        device = key_visible.device
    vis = torch.ones(n_query, n_key, dtype=torch.bool, device=device)
    if causal:
        vis = torch.tril(vis, diagonal=n_key - n_query)
    if key_visible is not None:
        vis = vis & key_visible.bool()[..., None, :]
    return vis


def uniform_pattern(n: int, causal: bool = False, key_visible: Bool[Tensor, "... key"] | None = None,
                    dtype=torch.float64) -> Float[Tensor, "... query key"]:
    """Uniform attention under the given visibility: A[i, j] = 1/|V_i| for j in V_i (0 for empty rows)."""
    vis = visibility_mask(n, n, key_visible, causal).to(dtype)
    return vis / vis.sum(-1, keepdim=True).clamp_min(1)


def _default_query_mask(n_query: int, n_key: int, key_visible: Tensor | None) -> Tensor | None:
    # Default query set = all non-pad positions (spec §3 conventions), i.e. the visible keys when the
    # pattern is square; otherwise all rows.
    if key_visible is not None and n_query == n_key:
        return key_visible.bool()
    return None


# ----------------------------------------------------------------------------------------------
# §3.1 received attention
# ----------------------------------------------------------------------------------------------

def received_attention(pattern: Float[Tensor, "... query key"],
                       query_mask: Bool[Tensor, "... query"] | None = None,
                       key_visible: Bool[Tensor, "... key"] | None = None,
                       kind: Kind = "mass", causal: bool = False) -> Float[Tensor, "... key"]:
    """Attention received by each key, reduced over a query set Q (default: all non-pad rows).

    - ``mass``:       m_j = (1/|Q|) Σ_{i∈Q} A_ij            (AF's A^l_j; Σ_j m_j = 1 when Q = all rows)
    - ``visibility``: r_j = (1/|Q_j|) Σ_{i∈Q_j} A_ij, Q_j = {i ∈ Q : j ∈ V_i}   (Gu's α; = m_j when
      every query sees every key, i.e. bidirectional); 0 where Q_j is empty
    - ``cumulative``: α_j = Σ_{i∈Q} A_ij                    (Rulli / SAP column sum)

    ``causal`` only matters for ``visibility`` (which queries can see j); entries at invisible
    (query, key) pairs are zeroed so unmasked patterns with mass on padding do not leak into m_j.
    """
    n_q, n_k = pattern.shape[-2:]
    vis = visibility_mask(n_q, n_k, key_visible, causal, device=pattern.device)
    if query_mask is None:
        query_mask = _default_query_mask(n_q, n_k, key_visible)
    q = (torch.ones(n_q, dtype=torch.bool, device=pattern.device) if query_mask is None
         else query_mask.bool())[..., :, None].to(pattern.dtype)          # [..., query, 1]
    a = pattern * vis.to(pattern.dtype) * q
    col = a.sum(-2)                                                         # Σ_{i∈Q} A_ij
    if kind == "cumulative":
        return col
    if kind == "mass":
        return col / q.sum(-2).clamp_min(1)
    if kind == "visibility":
        n_seen = (vis.to(pattern.dtype) * q).sum(-2)                        # |Q_j|
        return torch.where(n_seen > 0, col / n_seen.clamp_min(1), torch.zeros_like(col))
    raise ValueError(f"unknown kind {kind!r}; expected mass | visibility | cumulative")


def _harmonic(n: Tensor) -> Tensor:
    """H_n = Σ_{k=1}^{n} 1/k for integer tensors (float64), H_0 = 0; exact summation."""
    n = n.long()
    m = int(n.max().item()) if n.numel() else 0
    steps = torch.arange(1, m + 1, dtype=torch.float64, device=n.device)
    table = torch.cat([torch.zeros(1, dtype=torch.float64, device=n.device), torch.cumsum(1.0 / steps, 0)])
    return table[n.clamp_min(0)]


def uniform_received(key_visible: Bool[Tensor, "... key"], causal: bool = False,
                     kind: Kind = "mass") -> Float[Tensor, "... key"]:
    """Closed-form received attention of *uniform* attention, query set = all visible rows.

    With n = |V| visible keys and ρ_j the rank of j among them (0-based): bidirectional m_j = 1/n;
    causal m_j = (H_n − H_{ρ_j})/n, r_j = (H_n − H_{ρ_j})/(n − ρ_j), α_j = H_n − H_{ρ_j}.
    In particular causal m_0 = H_n/n (the causal-mask share of column 0, §1.a).  Invisible keys: 0.
    """
    vis = key_visible.bool()
    n = vis.sum(-1, keepdim=True)
    if not causal:
        inv = 1.0 / n.clamp_min(1).to(torch.float64)
        per = {"mass": inv, "visibility": inv, "cumulative": torch.ones_like(inv)}[kind]
        return torch.where(vis, per.to(torch.float64).expand(vis.shape), torch.zeros((), dtype=torch.float64))
    rank = torch.cumsum(vis.long(), -1) - 1
    tail = _harmonic(n).expand(vis.shape) - _harmonic(rank)               # Σ_{ρ_i ≥ ρ_j} 1/(ρ_i + 1)
    denom = {"mass": n.expand(vis.shape), "visibility": n - rank, "cumulative": torch.ones_like(rank)}[kind]
    out = tail / denom.clamp_min(1).to(torch.float64)
    return torch.where(vis, out, torch.zeros((), dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# §3.2 anchor detection
# ----------------------------------------------------------------------------------------------

def _visible(received: Tensor, key_visible: Tensor | None) -> Tensor:
    vis = torch.isfinite(received)
    if key_visible is not None:
        vis = vis & key_visible.bool()
    return vis.expand(received.shape)


def _pop_stats(r: Tensor, vis: Tensor) -> tuple[Tensor, Tensor]:
    """Population mean and std over the visible keys (incl. j), keepdim."""
    n = vis.sum(-1, keepdim=True).clamp_min(1).to(r.dtype)
    rv = torch.where(vis, r, torch.zeros_like(r))
    mean = rv.sum(-1, keepdim=True) / n
    var = (torch.where(vis, (r - mean) ** 2, torch.zeros_like(r))).sum(-1, keepdim=True) / n
    return mean, var.sqrt()


def _loo_stats(r: Tensor, vis: Tensor) -> tuple[Tensor, Tensor]:
    """Leave-one-out mean μ_{−j} and population std σ_{−j} over the *other* visible keys."""
    rv = torch.where(vis, r, torch.zeros_like(r))
    m = (vis.sum(-1, keepdim=True) - 1).clamp_min(1).to(r.dtype)
    s1 = rv.sum(-1, keepdim=True) - rv
    s2 = (rv ** 2).sum(-1, keepdim=True) - rv ** 2
    mean = s1 / m
    var = (s2 / m - mean ** 2).clamp_min(0)
    return mean, var.sqrt()


def _top1(r: Tensor, vis: Tensor) -> Tensor:
    masked = torch.where(vis, r, torch.full_like(r, -torch.inf))
    hot = torch.zeros_like(vis)
    hot.scatter_(-1, masked.argmax(-1, keepdim=True), True)
    return hot & vis.any(-1, keepdim=True)


def detect_anchors(received: Float[Tensor, "... key"], rule: Rule = "zscore", eps: float | None = None,
                   floor: float = 2.0, key_visible: Bool[Tensor, "... key"] | None = None,
                   causal: bool = False, k: int = 1, kind: Kind = "mass") -> Bool[Tensor, "... key"]:
    """Anchor (floating token / sink) set S per series, as a key mask.  ``eps=None`` = rule default.

    Over the visible keys V (n = |V|), with c = ``received``:

    - ``zscore`` (default, §3.2): j ∈ S iff c_j > μ_{−j} + ε·σ_{−j} (leave-one-out mean / population
      std of the other visible keys) and c_j ≥ floor·u_j, u_j = uniform-attention value at j under the
      same visibility (1/n bidirectional; causal harmonic tail, see :func:`uniform_received`, computed
      for ``kind``).  ε = 3.  No fallback: S = ∅ is a valid answer.
    - ``paper_absorption`` (AF Rule A): c_j > mean_{k≠j} c_k + ε (ε = 3, *absolute*), top-1 fallback
      if empty.  For column means (≤ 1) the rule can never fire, so this is exactly the top-1 key.
    - ``paper_temporal`` (Rule B): c_j > mean(c) + ε·std(c), population over all visible keys incl. j;
      no fallback.
    - ``paper_qk`` (Rule C): as B; if std(c) ≈ 0, S = ∅; otherwise top-1 fallback if empty.
    - ``gu``: only the first visible key (position 0 without left padding): S = {0} iff c_0 > ε,
      ε = 0.3 (Gu's Sink^ε; pass ``kind="visibility"`` received, which equals m_0 anyway).
    - ``rulli``: c_j > mean_{k≠j} c_k + ε (ε = 3) — meaningful only on *cumulative* received
      attention α_j = Σ_i A_ij (mean ≈ 1), where it means "≥ ~4 queries' worth"; fidelity to Rulli
      et al. UNCONFIRMED.
    - ``topk``: the k largest visible keys (k clipped to n).

    ``causal`` / ``kind`` only shape the zscore mass floor.  Invisible keys are never anchors.
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
    eps = _DEFAULT_EPS[rule] if eps is None else float(eps)
    r = received.to(torch.float64)          # float64: uniform rows must give exact ties
    vis = _visible(r, key_visible)
    n = vis.sum(-1, keepdim=True)

    if rule == "zscore":
        mu, sd = _loo_stats(r, vis)
        base = uniform_received(vis, causal=causal, kind=kind)
        out = (r > mu + eps * sd) & (r >= floor * base) & (n >= 2)
    elif rule in ("paper_absorption", "rulli"):
        mu, _ = _loo_stats(r, vis)
        out = (r > mu + eps) & (n >= 2)
        if rule == "paper_absorption":
            out = torch.where(out.any(-1, keepdim=True), out, _top1(r, vis))
    elif rule in ("paper_temporal", "paper_qk"):
        mu, sd = _pop_stats(r, vis)
        out = r > mu + eps * sd
        if rule == "paper_qk":
            flat = sd <= _STD_ZERO
            out = torch.where(out.any(-1, keepdim=True), out, _top1(r, vis)) & ~flat
    elif rule == "gu":
        first = torch.zeros_like(vis)
        first.scatter_(-1, vis.long().argmax(-1, keepdim=True), True)
        out = first & (r > eps)
    else:  # topk
        kk = max(0, min(int(k), r.shape[-1]))
        masked = torch.where(vis, r, torch.full_like(r, -torch.inf))
        out = torch.zeros_like(vis)
        if kk:
            out.scatter_(-1, masked.topk(kk, dim=-1).indices, True)
    return out & vis


# ----------------------------------------------------------------------------------------------
# §1.b / §3.3 absorption
# ----------------------------------------------------------------------------------------------

def absorption(received: Float[Tensor, "... key"], anchors: Bool[Tensor, "... key"]) -> Float[Tensor, "..."]:
    """Absorb(S) = 100 · Σ_{j∈S} m_j / Σ_j m_j  (percent; = 100 Σ_{j∈S} m_j for full-row mass).

    NaN where Σ_j m_j = 0.
    """
    r = received.to(torch.float64)
    total = r.sum(-1)
    part = torch.where(anchors.bool(), r, torch.zeros_like(r)).sum(-1)
    return torch.where(total > 0, 100.0 * part / total.clamp_min(1e-300), torch.full_like(total, torch.nan))


def uniform_null(T: int, causal: bool = False, variant: Literal["pos0", "top1"] = "pos0",
                 query_mask: Bool[Tensor, "query"] | Sequence[bool] | None = None,
                 positions: Sequence[int] | None = None, percent: bool = True) -> float:
    """Absorption of *uniform* attention over T visible keys, computed from the explicit matrix.

    Builds A_ij = 1/|V_i| (causal: V_i = {0..i}), takes the mass m_j over the query rows (default
    all), and returns 100·m_0 (``pos0``), 100·max_j m_j (``top1``), or 100·Σ_{j∈positions} m_j.
    All rows: bidirectional 100/T for both; causal 100·H_T/T for both (column 0 is the largest).
    """
    a = uniform_pattern(T, causal)
    qm = None if query_mask is None else torch.as_tensor(query_mask, dtype=torch.bool)
    m = received_attention(a, query_mask=qm, kind="mass")
    if positions is not None:
        val = m[list(positions)].sum()
    elif variant == "pos0":
        val = m[0]
    elif variant == "top1":
        val = m.max()
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return float(val) * (100.0 if percent else 1.0)


@dataclass
class AbsorptionResult(ResultMixin):
    """Three absorption variants (percent) with uniform-attention nulls and excess = value − null.

    ``pos0``: S = {first visible key} (AF-ARM); ``top1``: S = {argmax m_j} (AF-MDM in practice);
    ``anchors``: S = the detector's anchor set.  Nulls assume the query set = all visible rows.
    """

    pos0: Tensor
    top1: Tensor
    anchors: Tensor
    null_pos0: Tensor
    null_top1: Tensor
    null_anchors: Tensor
    excess_pos0: Tensor
    excess_top1: Tensor
    excess_anchors: Tensor
    n_anchors: Tensor
    n_visible: Tensor

    _dims: ClassVar = {name: () for name in (
        "pos0", "top1", "anchors", "null_pos0", "null_top1", "null_anchors",
        "excess_pos0", "excess_top1", "excess_anchors", "n_anchors", "n_visible")}


def absorption_variants(received: Float[Tensor, "... key"], key_visible: Bool[Tensor, "... key"] | None = None,
                        causal: bool = False, anchors: Bool[Tensor, "... key"] | None = None,
                        rule: Rule = "zscore") -> AbsorptionResult:
    """Absorb_pos0 / Absorb_top1 / Absorb_anchors of mass received attention, each with its null.

    Nulls (uniform attention, same visibility, all visible rows as queries): pos0 and top1 →
    100·H_n/n causal, 100/n bidirectional; anchors → 100·Σ_{j∈S} u_j (uniform mass on the same set).
    ``anchors=None`` runs :func:`detect_anchors` with ``rule``.
    """
    r = received.to(torch.float64)
    vis = _visible(r, key_visible)
    if anchors is None:
        anchors = detect_anchors(r, rule=rule, key_visible=vis, causal=causal)
    anchors = anchors.bool() & vis
    first = torch.zeros_like(vis)
    first.scatter_(-1, vis.long().argmax(-1, keepdim=True), True)
    first &= vis
    top = _top1(r, vis)
    u = 100.0 * uniform_received(vis, causal=causal, kind="mass")

    def null(mask: Tensor) -> Tensor:
        return torch.where(mask, u, torch.zeros_like(u)).sum(-1)

    vals = {"pos0": absorption(r, first), "top1": absorption(r, top), "anchors": absorption(r, anchors)}
    # top-1 null = max_j u_j (= first visible key when causal), not u at the observed argmax
    nulls = {"pos0": null(first), "top1": torch.where(vis, u, torch.zeros_like(u)).amax(-1),
             "anchors": null(anchors)}
    return AbsorptionResult(
        **vals, **{f"null_{k}": v for k, v in nulls.items()},
        **{f"excess_{k}": vals[k] - nulls[k] for k in vals},
        n_anchors=anchors.sum(-1), n_visible=vis.sum(-1))


# ----------------------------------------------------------------------------------------------
# §3.4 drift across steps
# ----------------------------------------------------------------------------------------------

ANCHOR_TYPES: tuple[str, ...] = ("prompt", "committed", "just_committed", "masked")


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


def spearman(x: Float[Tensor, "... n"], y: Float[Tensor, "... n"]) -> Float[Tensor, "..."]:
    """Spearman ρ = Pearson correlation of average ranks, over pairs where both are finite.

    NaN with < 2 valid pairs or a constant series.
    """
    x, y = torch.broadcast_tensors(x.to(torch.float64), y.to(torch.float64))
    valid = torch.isfinite(x) & torch.isfinite(y)
    return _pearson(_ranks(x, valid), _ranks(y, valid), valid)


def ols_slope(x: Float[Tensor, "... n"], y: Float[Tensor, "... n"]) -> Float[Tensor, "..."]:
    """OLS slope β = Σ(x−x̄)(y−ȳ)/Σ(x−x̄)² over finite pairs; NaN with < 2 pairs or constant x."""
    x, y = torch.broadcast_tensors(x.to(torch.float64), y.to(torch.float64))
    valid = torch.isfinite(x) & torch.isfinite(y)
    n = valid.sum(-1, keepdim=True).clamp_min(1).to(torch.float64)
    zero = torch.zeros_like(x)
    dx = torch.where(valid, x - torch.where(valid, x, zero).sum(-1, keepdim=True) / n, zero)
    dy = torch.where(valid, y - torch.where(valid, y, zero).sum(-1, keepdim=True) / n, zero)
    sxx = (dx * dx).sum(-1)
    ok = (valid.sum(-1) >= 2) & (sxx > 0)
    return torch.where(ok, (dx * dy).sum(-1) / sxx.clamp_min(1e-300), torch.full_like(sxx, torch.nan))


def wasserstein1(p: Float[Tensor, "... key"], q: Float[Tensor, "... key"]) -> Float[Tensor, "..."]:
    """W1 between two mass profiles over positions 0..K−1 (unit spacing), each normalised to sum 1:
    W1 = Σ_j |CDF_p(j) − CDF_q(j)|  (in tokens).  NaN if either has zero mass."""
    p, q = p.to(torch.float64), q.to(torch.float64)
    sp, sq = p.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
    w = (torch.cumsum(p / sp, -1) - torch.cumsum(q / sq, -1)).abs().sum(-1)
    ok = (sp > 0).squeeze(-1) & (sq > 0).squeeze(-1)
    return torch.where(ok, w, torch.full_like(w, torch.nan))


@dataclass
class DriftResult(ResultMixin):
    """Anchor drift over steps for each series (leading shape ``...``).  See :func:`drift`."""

    persistence: Tensor          # [..., key]     π_j
    modal_anchor: Tensor         # [...]          argmax π_j (−1 if never any anchor)
    stability: Tensor            # [...]          π_{j*}
    n_anchors: Tensor            # [..., step]    |S_s|
    empty_fraction: Tensor       # [...]          fraction of steps with S_s = ∅
    jaccard: Tensor              # [..., pair]    |S_s ∩ S_{s+1}| / |S_s ∪ S_{s+1}| (both empty: 1)
    mean_jaccard: Tensor         # [...]          J̄
    drift_index: Tensor          # [...]          1 − J̄
    n_distinct: Tensor           # [...]          U = |∪_s S_s|
    top1: Tensor                 # [..., step]    argmax_j r_j(s)
    top1_change_rate: Tensor     # [...]
    centroid: Tensor             # [..., step]    mass-weighted mean position of S_s (NaN if empty)
    centroid_slope: Tensor       # [...]          OLS slope of c_s on s (tokens/step)
    centroid_spearman: Tensor    # [...]          Spearman ρ(s, c_s)
    w1: Tensor                   # [..., pair]    W1(r(s), r(s+1)) in tokens
    mean_w1: Tensor              # [...]
    anchor_types: Tensor | None  # [..., step, type] anchor counts by ANCHOR_TYPES (needs commit_step)

    _dims: ClassVar = {
        "persistence": ("key",), "modal_anchor": (), "stability": (), "n_anchors": ("step",),
        "empty_fraction": (), "jaccard": ("pair",), "mean_jaccard": (), "drift_index": (),
        "n_distinct": (), "top1": ("step",), "top1_change_rate": (), "centroid": ("step",),
        "centroid_slope": (), "centroid_spearman": (), "w1": ("pair",), "mean_w1": (),
        "anchor_types": ("step", "type")}

    def _coords(self):
        return {"type": ANCHOR_TYPES}


def anchor_types(anchors: Bool[Tensor, "... step key"], commit_step: Int[Tensor, "... key"]) -> Int[Tensor, "... step type"]:
    """Count anchors at each step by token type (``ANCHOR_TYPES`` order).

    At step s the input x_s holds the tokens committed at steps < s.  For a key with commit step c:
    prompt: c < 0; committed: 0 ≤ c < s−1; just_committed: c = s−1; masked: c ≥ s (still [MASK]).
    """
    n_steps = anchors.shape[-2]
    s = torch.arange(n_steps, device=anchors.device)[:, None]               # [step, 1]
    c = commit_step.long()[..., None, :]                                     # [..., 1, key]
    cats = torch.stack(torch.broadcast_tensors(c < 0, (c >= 0) & (c < s - 1), (c >= 0) & (c == s - 1), c >= s), -1)
    return (anchors.bool()[..., None] & cats).sum(-2)


def drift(anchors: Bool[Tensor, "... step key"], received: Float[Tensor, "... step key"],
          commit_step: Int[Tensor, "... key"] | None = None,
          key_visible: Bool[Tensor, "... key"] | None = None) -> DriftResult:
    """Stability / turnover / position drift of the anchor sets S_s, s = 0..S−1 (§3.4).

    π_j = (1/S) Σ_s 1[j ∈ S_s]; J̄ = mean_s Jaccard(S_s, S_{s+1}); U = |∪ S_s|; top-1 change rate =
    fraction of s with argmax r(s) ≠ argmax r(s+1); centroid c_s = Σ_{j∈S_s} r_j j / Σ_{j∈S_s} r_j
    (unweighted mean if the anchors carry no mass; NaN if S_s = ∅) with its OLS slope and Spearman ρ
    against s; W1 between consecutive r(s) over positions.
    """
    r = received.to(torch.float64)
    vis = torch.isfinite(r)
    if key_visible is not None:
        vis = vis & key_visible.bool()[..., None, :]
    vis = vis.expand(r.shape)
    r = torch.where(vis, r, torch.zeros_like(r))
    a = anchors.bool().expand(r.shape) & vis
    n_steps, n_keys = a.shape[-2:]
    af = a.to(torch.float64)

    persistence = af.mean(-2)
    modal = persistence.argmax(-1)
    stability = persistence.amax(-1)
    modal = torch.where(stability > 0, modal, torch.full_like(modal, -1))
    n_anchors = a.sum(-1)

    inter = (a[..., 1:, :] & a[..., :-1, :]).sum(-1).to(torch.float64)
    union = (a[..., 1:, :] | a[..., :-1, :]).sum(-1).to(torch.float64)
    jac = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))
    mean_jac = jac.mean(-1) if n_steps > 1 else torch.full(jac.shape[:-1], torch.nan, dtype=torch.float64)

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

    w1 = wasserstein1(r[..., :-1, :], r[..., 1:, :])
    return DriftResult(
        persistence=persistence, modal_anchor=modal, stability=stability, n_anchors=n_anchors,
        empty_fraction=(n_anchors == 0).to(torch.float64).mean(-1),
        jaccard=jac, mean_jaccard=mean_jac, drift_index=1.0 - mean_jac,
        n_distinct=a.any(-2).sum(-1), top1=top1, top1_change_rate=change_rate,
        centroid=centroid, centroid_slope=ols_slope(steps, centroid),
        centroid_spearman=spearman(steps, centroid),
        w1=w1, mean_w1=w1.nanmean(-1) if n_steps > 1 else torch.full(w1.shape[:-1], torch.nan, dtype=torch.float64),
        anchor_types=None if commit_step is None else anchor_types(a, commit_step))


# ----------------------------------------------------------------------------------------------
# §3.5 fixed sink vs floating
# ----------------------------------------------------------------------------------------------

LAYER_LABELS: tuple[str, ...] = ("fixed_initial", "fixed_anchor", "floating", "diffuse", "other")


def initial_absorption(received: Float[Tensor, "... step key"], key_visible: Bool[Tensor, "... key"] | None = None,
                       n_initial: int = 4) -> Float[Tensor, "..."]:
    """Absorb_{pos<n_initial} per step (percent of mass on the first n_initial visible keys, the
    StreamingLLM sink window), reduced by the (lower) median over steps."""
    r = received.to(torch.float64)
    vis = torch.ones_like(r, dtype=torch.bool) if key_visible is None else key_visible.bool()[..., None, :].expand(r.shape)
    rank = torch.cumsum(vis.long(), -1) - 1
    per_step = absorption(torch.where(vis, r, torch.zeros_like(r)), vis & (rank < n_initial))
    return per_step.median(-1).values


@dataclass
class LayerClassification(ResultMixin):
    """Per-series labels (``LAYER_LABELS``) with the quantities that decided them."""

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
    d = drift_result
    stab, modal = to_numpy(d.stability), to_numpy(d.modal_anchor)
    uniq, empty = to_numpy(d.n_distinct), to_numpy(d.empty_fraction)
    init = np.broadcast_to(to_numpy(initial_absorption), stab.shape)
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

