"""Floating tokens / attention sinks: anchor detection and the absorption of anchor sets against baselines.

Received attention and masks live in :mod:`mdm_lens.probes.received`, drift and layer labels in
:mod:`mdm_lens.probes.drift`; both are re-exported here (their historical home).

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

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

from . import _checks as C
from ._ignored import refuse_ignored
from ._results import ResultMixin
# measurement half (masks, received attention, Absorb): its own module, re-exported here as before
from .received import (KINDS, Kind, absorption, align_mask, received_attention, uniform_pattern,
                       uniform_received, visibility_mask)

__all__ = [
    "align_mask", "visibility_mask", "uniform_pattern", "received_attention", "uniform_received",
    "detect_anchors", "absorption", "uniform_null", "absorption_variants", "AbsorptionResult",
    "drift", "DriftResult", "anchor_types", "spearman", "ols_slope", "wasserstein1", "initial_absorption",
    "classify_layer", "LayerClassification", "ANCHOR_TYPES", "LAYER_LABELS", "RULES", "KINDS",
    "STD_ZERO", "RULE_B_ULPS",
]

Rule = Literal["zscore", "paper_absorption", "paper_temporal", "paper_qk", "gu", "rulli", "topk"]
RULES: tuple[str, ...] = ("zscore", "paper_absorption", "paper_temporal", "paper_qk", "gu", "rulli", "topk")
# Rule-specific default thresholds (eps=None picks these).
_DEFAULT_EPS = {"zscore": 3.0, "paper_absorption": 3.0, "paper_temporal": 3.0, "paper_qk": 3.0,
                "gu": 0.3, "rulli": 3.0, "topk": 0.0}
# Rule C's spread guard, as the reference's ``np.isclose(std, 0.0)`` (atol 1e-8): std <= 1e-8 skips the 3-sigma
# test, and the top-1 fallback then still runs (a flat head gives [argmax] = the first visible key).
STD_ZERO = 1e-8
# Rules B/C: c_j must exceed the threshold by more than RULE_B_ULPS ulps of the *input* dtype, relative to
# |threshold|. Without it a flat row whose column sums differ by one ulp (summation order) has a lone "spike"
# whose z-score is sqrt(T - 1) > 3, a spurious anchor that depends on the summation order. The guard is the
# input's precision and nothing more, so differences the input dtype does resolve (1e-6 in float64) are
# judged exactly as the reference, which has no guard, judges them.
RULE_B_ULPS = 8


# ----------------------------------------------------------------------------------------------
# §3.2 anchor detection
# ----------------------------------------------------------------------------------------------

def _visible(received: Tensor, key_visible: Tensor | None, policy: str) -> Tensor:
    """Keys that take part: ``key_visible`` (default all), minus non-finite ones under ``nan_policy="omit"``;
    under ``"raise"`` a non-finite *visible* key is an error."""
    vis = torch.ones_like(received, dtype=torch.bool) if key_visible is None else key_visible.expand(received.shape)
    C.finite_where(received, vis, name="received", policy=policy)
    return vis & torch.isfinite(received)


def _nonnegative(received: Tensor, vis: Tensor) -> Tensor:
    """``received`` at the visible keys in float64 (0 elsewhere), refused when a visible entry is negative: received
    attention is a mass, and a difference of two records passed by mistake would give a silent empty anchor set."""
    r = torch.where(vis, received.to(torch.float64), torch.zeros((), dtype=torch.float64))
    if bool((r < 0).any()):
        raise ArgumentError("received has negative entries: received attention is a mass, expected values >= 0.",
                            argument="received", value=received, allowed="values >= 0")
    return r


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
    """One-hot of the first visible argmax (numpy/torch argmax: first of ties); empty if nothing is visible."""
    masked = torch.where(vis, r, torch.full_like(r, -torch.inf))
    hot = torch.zeros_like(vis)
    hot.scatter_(-1, masked.argmax(-1, keepdim=True), True)
    return hot & vis.any(-1, keepdim=True)


def _rule_b_rtol(dtype: torch.dtype) -> float:
    return RULE_B_ULPS * torch.finfo(dtype).eps


# which rules read each tuning argument, and the value that means "not given" (the default); `causal` is not here:
# it describes the received attention (every caller passes the model's mask), not a rule's parameter
_RULE_ARGUMENTS = {"eps": (None, tuple(r for r in RULES if r != "topk"), "it sets the threshold of the other rules"),
                   "floor": (2.0, ("zscore",), "only the zscore rule has a mass floor"),
                   "kind": ("mass", ("zscore",), "it only shapes the zscore rule's mass floor"),
                   "k": (1, ("topk",), "only the topk rule keeps k keys")}


def _refuse_other_rules_arguments(rule: str, **given: object) -> None:
    """An argument only another rule reads (``detect_anchors(r, k=3)`` under the default zscore) is refused naming
    both, instead of returning the zscore anchors as if k had been used."""
    for name, value in given.items():
        neutral, readers, why = _RULE_ARGUMENTS[name]
        if rule not in readers:
            refuse_ignored(name, value, neutral, by="rule", by_value=rule,
                           why=f"{why} ({', '.join(map(repr, readers))})")


def detect_anchors(received: Float[Tensor, "... key"], rule: Rule = "zscore", eps: float | None = None,
                   floor: float = 2.0, key_visible: Bool[Tensor, "... key"] | None = None,
                   causal: bool = False, k: int = 1, kind: Kind = "mass",
                   nan_policy: str = "raise") -> Bool[Tensor, "... key"]:
    """Anchor (floating token / sink) set S per series, as a key mask.  ``eps=None`` = rule default.

    Over the visible keys V (n = |V|), with c = ``received``:

    - ``zscore`` (default, §3.2): j ∈ S iff c_j > μ_{−j} + ε·σ_{−j} (leave-one-out mean / population
      std of the other visible keys) and c_j ≥ floor·u_j, u_j = uniform-attention value at j under the
      same visibility (1/n bidirectional; causal harmonic tail, see :func:`uniform_received`, computed
      for ``kind``).  ε = 3, floor = 2.  No fallback: S = ∅ is a valid answer.
    - ``paper_absorption`` (AF Rule A): c_j > mean_{k≠j} c_k + ε (ε = 3, *absolute*), top-1 fallback
      if empty.  For column means (≤ 1) the rule can never fire, so this is exactly the top-1 key.
    - ``paper_temporal`` (Rule B): c_j > mean(c) + ε·std(c), population over all visible keys incl. j;
      no fallback.  Relative guard: c_j must exceed the threshold t by more than ``RULE_B_ULPS`` = 8 ulps
      of the input dtype, times |t|, so one-ulp differences of column sums (a flat row summed in another
      order) never make an anchor, while anything the dtype resolves is judged as the reference does.
    - ``paper_qk`` (Rule C, ``QK_decomposition.py``): the 3σ test of B (same guard) is skipped when
      std(c) ≤ ``STD_ZERO`` = 1e-8 (the reference's ``np.isclose(std, 0)``); then, if S is empty, the
      top-1 fallback always runs — a flat head gives {first visible key}, never ∅.
    - ``gu``: only the first visible key (position 0 without left padding): S = {0} iff c_0 > ε,
      ε = 0.3 (Gu's Sink^ε; pass ``kind="visibility"`` received, which equals m_0 anyway).
    - ``rulli``: c_j > mean_{k≠j} c_k + ε (ε = 3) — meaningful only on *cumulative* received
      attention α_j = Σ_i A_ij (mean ≈ 1), where it means "≥ ~4 queries' worth"; fidelity to Rulli
      et al. UNCONFIRMED.
    - ``topk``: the k largest visible keys (1 ≤ k ≤ number of keys; fewer where fewer are visible).

    ``causal`` / ``kind`` only shape the zscore mass floor.  Invisible keys are never anchors.  An argument only
    another rule reads (``k`` without ``rule="topk"``, ``eps`` with it, ``floor`` / ``kind`` without zscore) raises
    ``ArgumentError`` naming both.
    NaN/inf at a visible key raises ``NonFiniteError``; ``nan_policy="omit"`` treats such keys as invisible
    (the convention of step series whose not-yet-existing keys are NaN).
    """
    received = C.float_tensor(received, name="received")
    rule = validate.choice(rule, RULES, name="rule")
    given_eps = eps
    eps = _DEFAULT_EPS[rule] if eps is None else validate.number(eps, name="eps", min=0)
    floor = validate.number(floor, name="floor", min=0)
    key_visible = C.mask(key_visible, name="key_visible", size=received.shape[-1], against=received.shape)
    causal = validate.boolean(causal, name="causal")
    k = validate.integer(k, name="k", min=1, max=received.shape[-1] if rule == "topk" else None)
    kind = validate.choice(kind, KINDS, name="kind")
    _refuse_other_rules_arguments(rule, eps=given_eps, floor=floor, k=k, kind=kind)  # after the type checks
    policy = C.nan_policy(nan_policy)
    vis = _visible(received, key_visible, policy)
    r = _nonnegative(received, vis)  # f64: exact ties
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
        thr = mu + eps * sd
        out = (r - thr) > _rule_b_rtol(received.dtype) * thr.abs()
        if rule == "paper_qk":
            out = out & (sd > STD_ZERO)                                    # guard: skip the 3σ test ...
            out = torch.where(out.any(-1, keepdim=True), out, _top1(r, vis))  # ... the fallback still runs
    elif rule == "gu":
        first = torch.zeros_like(vis)
        first.scatter_(-1, vis.long().argmax(-1, keepdim=True), True)
        out = first & (r > eps)
    else:  # topk
        masked = torch.where(vis, r, torch.full_like(r, -torch.inf))
        out = torch.zeros_like(vis)
        out.scatter_(-1, masked.topk(k, dim=-1).indices, True)
    return out & vis


# ----------------------------------------------------------------------------------------------
# §1.b / §3.3 absorption
# ----------------------------------------------------------------------------------------------

def uniform_null(T: int, causal: bool = False, variant: Literal["pos0", "top1"] = "pos0",
                 query_mask: Bool[Tensor, "query"] | Sequence[bool] | None = None,
                 positions: Sequence[int] | None = None, percent: bool = True) -> float:
    """Absorption of *uniform* attention over T visible keys, computed from the explicit matrix.

    Builds A_ij = 1/|V_i| (causal: V_i = {0..i}), takes the mass m_j over the query rows (default
    all), and returns 100·m_0 (``pos0``), 100·max_j m_j (``top1``), or 100·Σ_{j∈positions} m_j.
    All rows: bidirectional 100/T for both; causal 100·H_T/T for both (column 0 is the largest).
    """
    T = validate.integer(T, name="T", min=1)
    variant = validate.choice(variant, ("pos0", "top1"), name="variant")
    percent = validate.boolean(percent, name="percent")
    a = uniform_pattern(T, causal)
    qm = None
    if query_mask is not None:
        if not isinstance(query_mask, Tensor):
            if isinstance(query_mask, (str, bytes)) or not all(isinstance(b, bool) for b in query_mask):
                raise C.ArgumentTypeError(f"query_mask={validate.describe(query_mask)} is invalid: expected a bool "
                                          "tensor or a sequence of bools.", argument="query_mask",
                                          value=query_mask, allowed="bools")
            query_mask = torch.tensor(list(query_mask), dtype=torch.bool)
        qm = C.mask(query_mask, name="query_mask", size=T, against=(T,))
    m = received_attention(a, query_mask=qm, kind="mass")
    if positions is not None:
        val = m[validate.indices(positions, T, name="positions", what="position")].sum()
    elif variant == "pos0":
        val = m[0]
    else:
        val = m.max()
    return float(val) * (100.0 if percent else 1.0)


@dataclass
class AbsorptionResult(ResultMixin):
    """Three absorption variants (percent) with uniform-attention nulls and excess = value − null.

    Every field has the leading shape of ``received`` without its key axis:

    - ``pos0``: S = {first visible key} (AF-ARM); ``top1``: S = {argmax m_j} (AF-MDM in practice);
      ``anchors``: S = the detector's anchor set;
    - ``null_pos0`` / ``null_top1``: uniform attention under the same visibility (100/n bidirectional,
      100·H_n/n causal, n visible keys); ``null_anchors``: 100·Σ_{j∈S} u_j, the uniform mass on S;
    - ``excess_*`` = value − null (percentage points);
    - ``n_anchors`` = |S|, ``n_visible`` = n.

    Nulls assume the query set = all visible rows.
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
                        rule: Rule = "zscore", nan_policy: str = "raise",
                        block_length: int | None = None) -> AbsorptionResult:
    """Absorb_pos0 / Absorb_top1 / Absorb_anchors of mass received attention, each with its null.

    ``block_length`` (block-causal models: LLaDA2.x, SDAR): the nulls are uniform attention under the block mask
    (each query 1/|V_i| over the keys of its own and earlier blocks), not 100/n.

    Nulls (uniform attention, same visibility, all visible rows as queries): pos0 and top1 →
    100·H_n/n causal, 100/n bidirectional; anchors → 100·Σ_{j∈S} u_j (uniform mass on the same set).
    ``anchors=None`` runs :func:`detect_anchors` with ``rule``.  NaN/inf at a visible key raises
    (``nan_policy="omit"``: such keys are invisible).
    """
    received = C.float_tensor(received, name="received")
    key_visible = C.mask(key_visible, name="key_visible", size=received.shape[-1], against=received.shape)
    anchors = C.mask(anchors, name="anchors", size=received.shape[-1], against=received.shape)
    causal = validate.boolean(causal, name="causal")
    rule = validate.choice(rule, RULES, name="rule")
    if anchors is not None:  # given anchors are the set: a rule would pick nothing
        refuse_ignored("rule", rule, "zscore", by="anchors", by_value=validate.describe(anchors),
                       why="rule detects the anchors only when anchors=None")
    policy = C.nan_policy(nan_policy)
    vis = _visible(received, key_visible, policy)
    r = _nonnegative(received, vis)
    if anchors is None:
        anchors = detect_anchors(r, rule=rule, key_visible=vis, causal=causal)
    anchors = anchors & vis
    first = torch.zeros_like(vis)
    first.scatter_(-1, vis.long().argmax(-1, keepdim=True), True)
    first &= vis
    top = _top1(r, vis)
    u = 100.0 * uniform_received(vis, causal=causal, kind="mass", block_length=block_length)

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


# §3.4 / §3.5 live in drift.py; re-exported here (their historical home).
from .drift import (ANCHOR_TYPES, LAYER_LABELS, DriftResult, LayerClassification, anchor_types,  # noqa: E402
                    classify_layer, drift, initial_absorption, ols_slope, spearman, wasserstein1)
