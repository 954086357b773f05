"""Norm-vs-angle decomposition of an anchor key's QK advantage (spec §1.c, §3.6).

With a_j = ‖k_j‖ and b_ij = ‖q_i‖ cos θ_ij we have q_i·k_j = a_j b_ij, so the anchor j*'s logit
advantage over a reference key j splits exactly (2-factor Shapley) into a key-norm and an angle term:

    a* b_i* − a_j b_ij = (a* − a_j)(b_i* + b_ij)/2  +  (b_i* − b_ij)(a* + a_j)/2
                         └──── norm term ────┘       └──── angle term ────┘

Averaged over j ∈ R_i (visible non-anchor keys of query i), then over queries, and divided by
√d_head, this gives Δ = N + G in logit units (exact, no residual).

Inputs are post-RoPE per-head vectors in TransformerLens layout: ``q [batch, pos, head, d_head]``,
``k / v [batch, pos, kv_head, d_head]``; GQA maps query head h to kv head h // (H / H_kv) (HF
``repeat_kv``).  Results are computed per head and *then* averaged — never the vectors.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, OutOfRangeError

from . import _checks as C
from ._results import ResultMixin, to_numpy
from .floating import visibility_mask

__all__ = ["kv_head_index", "expand_kv", "decompose", "QKDecomposition", "qk_label",
           "paper_qk_maps", "PaperQKMaps", "QK_LABELS"]

Mode = Literal["default", "paper"]
QK_LABELS: tuple[str, ...] = ("angle-driven", "norm-driven", "combined", "no-advantage")
MODES: tuple[str, ...] = ("default", "paper")
COS_EPS = 1e-12   # the reference's cos = qk / max(‖q‖‖k‖, 1e-12): 0 (not NaN) for a zero vector


def kv_head_index(n_heads: int, n_kv_heads: int, mode: Mode = "default") -> Int[Tensor, "head"]:
    """kv head used by each query head: h // (H / H_kv) (HF repeat_kv); ``paper``: h % H_kv (AF bug)."""
    n_heads = validate.integer(n_heads, name="n_heads", min=1)
    n_kv_heads = validate.integer(n_kv_heads, name="n_kv_heads", min=1)
    mode = validate.choice(mode, MODES, name="mode")
    if n_heads % n_kv_heads:
        raise ArgumentError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}: every kv head must "
                            "serve the same number of query heads.", argument="n_kv_heads", value=n_kv_heads,
                            allowed=f"a divisor of {n_heads}")
    h = torch.arange(n_heads)
    return h % n_kv_heads if mode == "paper" else h // (n_heads // n_kv_heads)


def expand_kv(k: Float[Tensor, "batch pos kv_head d"], n_heads: int,
              mode: Mode = "default") -> Float[Tensor, "batch pos head d"]:
    """Per-query-head copy of GQA keys/values (``default`` ≡ ``repeat_interleave(rep, dim=2)``)."""
    validate.tensor(k, name="k", ndim=4, dtype="float")
    return k[:, :, kv_head_index(n_heads, k.shape[2], mode).to(k.device)]


def _safe_div(x: Tensor, y: Tensor) -> Tensor:
    return torch.where(y != 0, x / torch.where(y != 0, y, torch.ones_like(y)), torch.full_like(x, torch.nan))


def _share(part: Tensor, advantage: Tensor) -> Tensor:
    """A term's share of the anchor's advantage, N/Δ or G/Δ: defined only where there is an advantage (Δ > 0);
    NaN where Δ ≤ 0 (a head whose anchor is not preferred: "no-advantage", where N/Δ would be a meaningless or
    sign-flipped ratio)."""
    return torch.where(advantage > 0, part / torch.where(advantage > 0, advantage, torch.ones_like(advantage)),
                       torch.full_like(part, torch.nan))


def _masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    # where(), not x*m: entries outside the mask may be NaN (e.g. queries with no reference key)
    return _safe_div(torch.where(mask, x, torch.zeros_like(x)).sum(dim), mask.to(x.dtype).sum(dim))


def _z_vs_rest(col: Tensor, anchor_hot: Tensor, rest: Tensor) -> Tensor:
    """(x_* − mean_R x) / std_R x (population) along the key axis."""
    mu = _masked_mean(col, rest, -1)
    sd = _masked_mean((col - mu[..., None]) ** 2, rest, -1).sqrt()
    star = (col * anchor_hot).sum(-1)
    return _safe_div(star - mu, sd)


def _check_decompose(q: Any, k: Any, v: Any, anchor: Any, query_mask: Any, key_visible: Any, causal: Any,
                     share: Any) -> tuple[Any, float]:
    validate.tensor(q, name="q", ndim=(3, 4), dtype="float", finite=True)
    validate.tensor(k, name="k", ndim=q.ndim, dtype="float", finite=True)
    lead = q.shape[:-2]
    if tuple(k.shape[:-2]) != tuple(lead) or k.shape[-1] != q.shape[-1]:
        raise ArgumentError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}: expected the same "
                            "batch, positions and d_head.", argument="k", value=k,
                            allowed=f"shape {tuple(lead)} + (kv_head, {q.shape[-1]})")
    kv_head_index(q.shape[-2], k.shape[-2])                                 # heads divisible
    if v is not None:
        validate.tensor(v, name="v", ndim=q.ndim, dtype="float", finite=True)
        if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
            raise ArgumentError(f"v has shape {tuple(v.shape)} but k has shape {tuple(k.shape)}: expected the same "
                                "batch, positions and kv heads.", argument="v", value=v, allowed=f"{tuple(k.shape[:-1])} + (d,)")
    n_pos = q.shape[-3]
    batch_shape = tuple(lead[:-1])                                          # () unbatched, (batch,) batched
    C.mask(query_mask, name="query_mask", size=n_pos, against=batch_shape + (n_pos,))
    C.mask(key_visible, name="key_visible", size=n_pos, against=batch_shape + (n_pos,))
    validate.boolean(causal, name="causal")
    share = validate.number(share, name="share", min=0.5, max=1)
    if isinstance(anchor, Tensor):
        validate.tensor(anchor, name="anchor", ndim=(0, 1, 2), dtype="int")
        if bool(((anchor < -n_pos) | (anchor >= n_pos)).any()):
            raise OutOfRangeError(f"anchor={validate.describe(anchor)} holds positions outside [-{n_pos}, {n_pos - 1}].",
                                  argument="anchor", value=anchor, allowed=f"[-{n_pos}, {n_pos - 1}]")
        want = [(), batch_shape] + ([batch_shape + (q.shape[-2],)] if batch_shape else [(q.shape[-2],)])
        if tuple(anchor.shape) not in want:
            raise ArgumentError(f"anchor has shape {tuple(anchor.shape)}: expected one of {want}.", argument="anchor",
                                value=anchor, allowed=" or ".join(map(str, want)))
        return anchor % n_pos, share
    return validate.index(anchor, n_pos, name="anchor", what="position"), share


def qk_label(norm_term: Tensor, angle_term: Tensor, share: float = 0.8) -> np.ndarray:
    """§3.6 labels: no-advantage if Δ ≤ 0; angle-driven if N ≤ 0 or G/Δ ≥ 0.8; norm-driven if
    N/Δ ≥ 0.8; combined otherwise.  NaN/inf terms raise ``NonFiniteError`` (no label is right for them)."""
    share = validate.number(share, name="share", min=0.5, max=1)
    for name, t in (("norm_term", norm_term), ("angle_term", angle_term)):
        arr = to_numpy(t)
        if arr.dtype.kind not in "fiu":
            raise ArgumentTypeError(f"{name}={validate.describe(t)} is invalid: expected numbers.", argument=name,
                                    value=t, allowed="a float tensor")
        if not np.isfinite(arr.astype(float)).all():
            raise C.NonFiniteError(f"{name} holds NaN/inf ({validate.describe(t)}); a label needs finite terms (a "
                                   "head whose anchor has no reference key or query has none).", argument=name,
                                   value=t, allowed="finite values")
    n, g = to_numpy(norm_term).astype(float), to_numpy(angle_term).astype(float)
    if n.shape != g.shape:
        raise ArgumentError(f"angle_term has shape {g.shape} but norm_term has shape {n.shape}.", argument="angle_term",
                            value=angle_term, allowed=f"shape {n.shape}")
    d = n + g
    with np.errstate(divide="ignore", invalid="ignore"):
        gs, ns = g / d, n / d
    return np.select([~(d > 0), (n <= 0) | (gs >= share), ns >= share],
                     ["no-advantage", "angle-driven", "norm-driven"], default="combined").astype(object)


@dataclass
class QKDecomposition(ResultMixin):
    """Per (batch, head) decomposition Δ = N + G of the anchor's mean QK logit advantage, plus head means.

    ``to_frame()`` columns: ``metric`` (a field name), ``batch``, ``head`` (absent for the ``*_mean`` fields),
    ``value`` (logits for the terms, ratios / z-scores / shares otherwise), ``label`` (for ``labels``).
    """

    norm_term: Tensor            # [batch, head]  N
    angle_term: Tensor           # [batch, head]  G
    advantage: Tensor            # [batch, head]  Δ = N + G
    norm_share: Tensor           # [batch, head]  N/Δ (NaN where Δ ≤ 0: no advantage to share)
    angle_share: Tensor          # [batch, head]  G/Δ (likewise)
    key_norm_ratio: Tensor       # [batch, head]  ‖k*‖ / mean_R ‖k_j‖
    key_norm_z: Tensor           # [batch, head]  column z-score of ‖k*‖ among R
    cos_gap: Tensor              # [batch, head]  mean_i (cos_i* − mean_{R_i} cos_ij)
    cos_z: Tensor                # [batch, head]  z-score of the anchor's query-mean cos among R
    value_norm_ratio: Tensor | None  # [batch, head]  ‖v*‖ / mean_R ‖v_j‖ (if v given)
    labels: np.ndarray           # [batch, head]  QK_LABELS
    anchor: Tensor               # [batch, head]  j*
    n_queries: Tensor            # [batch, head]  queries averaged over
    norm_term_mean: Tensor       # [batch]  head means of the per-head results
    angle_term_mean: Tensor
    advantage_mean: Tensor
    norm_share_mean: Tensor
    labels_mean: np.ndarray      # [batch]

    _per_head = ("norm_term", "angle_term", "advantage", "norm_share", "angle_share", "key_norm_ratio",
                 "key_norm_z", "cos_gap", "cos_z", "value_norm_ratio", "labels", "anchor", "n_queries")
    _dims: ClassVar = {**{f: ("head",) for f in _per_head},
                       **{f: () for f in ("norm_term_mean", "angle_term_mean", "advantage_mean",
                                          "norm_share_mean", "labels_mean")}}

    def to_frame(self, lead_dims=("batch",), metrics=None):
        return super().to_frame(lead_dims=lead_dims, metrics=metrics)


def decompose(q: Float[Tensor, "batch pos head d"], k: Float[Tensor, "batch pos kv_head d"],
              anchor: int | Int[Tensor, "batch"] | Int[Tensor, "batch head"],
              query_mask: Bool[Tensor, "batch pos"] | None = None,
              key_visible: Bool[Tensor, "batch pos"] | None = None, causal: bool = False,
              v: Float[Tensor, "batch pos kv_head d"] | None = None, share: float = 0.8,
              block_length: int | None = None) -> QKDecomposition:
    """Shapley norm/angle split of the anchor key's QK advantage, per head (§3.6).

    N = (1/√d) mean_{i∈Q'} mean_{j∈R_i} (a* − a_j)(b_i* + b_ij)/2,
    G = (1/√d) mean_{i∈Q'} mean_{j∈R_i} (b_i* − b_ij)(a* + a_j)/2,
    Δ = N + G = (1/√d) mean_i mean_{j∈R_i} (q_i·k* − q_i·k_j).

    R_i = keys visible to i (``key_visible``, ``causal``, and with ``block_length`` B the block-causal mask:
    j // B <= i // B) other than j*; Q' = the query set (default
    the visible positions) restricted to queries that see j* and have R_i ≠ ∅.
    Unbatched ``[pos, head, d]`` inputs are accepted.  ``anchor`` is a position (negative counts from the
    end) or an int tensor ``[batch]`` / ``[batch, head]``; it must be a visible key.  NaN/inf in q, k or v
    raises ``NonFiniteError``.
    """
    anchor, share = _check_decompose(q, k, v, anchor, query_mask, key_visible, causal, share)
    if q.ndim == 3:
        q, k = q[None], k[None]
        v = None if v is None else v[None]
        query_mask = None if query_mask is None else query_mask[None]
        key_visible = None if key_visible is None else key_visible[None]
    batch, n_pos, n_heads, d_head = q.shape
    dt = torch.float64
    qh = rearrange(q.to(dt), "b p h d -> b h p d")
    kh = rearrange(expand_kv(k.to(dt), n_heads), "b p h d -> b h p d")

    a = kh.norm(dim=-1)                                                     # [b, h, key]   a_j
    q_norm = qh.norm(dim=-1)                                                # [b, h, query]
    dots = einsum(qh, kh, "b h i d, b h j d -> b h i j")                    # q_i·k_j
    bij = torch.where(a[..., None, :] > 0, dots / a[..., None, :].clamp_min(1e-300), torch.zeros_like(dots))
    cos = torch.where(q_norm[..., None] > 0, bij / q_norm[..., None].clamp_min(1e-300), torch.zeros_like(bij))

    kv_vis = None if key_visible is None else key_visible.bool()[:, None, :]
    vis = visibility_mask(n_pos, n_pos, kv_vis, causal, device=q.device,
                          block_length=block_length).expand(batch, n_heads, n_pos, n_pos)
    anc = torch.as_tensor(anchor, device=q.device).long()
    anc = (anc[:, None] if anc.ndim == 1 else anc).expand(batch, n_heads)
    if key_visible is not None and not bool(key_visible.bool().gather(1, anc).all()):
        raise OutOfRangeError(f"anchor={validate.describe(anchor)} names a key hidden by key_visible (padding) in some "
                              "row: the anchor must be a visible key.", argument="anchor", value=anchor,
                              allowed="a visible key position")
    hot = torch.nn.functional.one_hot(anc, n_pos).bool()                    # [b, h, key]
    ref = vis & ~hot[..., None, :]                                          # R_i
    qm = torch.ones(batch, n_pos, dtype=torch.bool, device=q.device) if query_mask is None else query_mask.bool()
    if query_mask is None and key_visible is not None:
        qm = key_visible.bool()
    sees_anchor = (vis & hot[..., None, :]).any(-1)
    qvalid = qm[:, None, :] & sees_anchor & ref.any(-1)                     # Q'  [b, h, query]

    a_star = (a * hot).sum(-1)                                              # [b, h]
    b_star = (bij * hot[..., None, :]).sum(-1)                              # [b, h, query]
    n_ij = (a_star[..., None, None] - a[..., None, :]) * (b_star[..., None] + bij) / 2
    g_ij = (b_star[..., None] - bij) * (a_star[..., None, None] + a[..., None, :]) / 2
    scale = 1.0 / math.sqrt(d_head)
    norm_term = _masked_mean(_masked_mean(n_ij, ref, -1), qvalid, -1) * scale
    angle_term = _masked_mean(_masked_mean(g_ij, ref, -1), qvalid, -1) * scale
    adv = norm_term + angle_term

    rest = vis.any(-2) & ~hot                                               # visible non-anchor keys
    cos_star = (cos * hot[..., None, :]).sum(-1)
    cos_gap = _masked_mean(cos_star - _masked_mean(cos, ref, -1), qvalid, -1)
    cos_col = _masked_mean(cos, vis & qvalid[..., None], -2)                # query-mean cos per key
    value_ratio = None
    if v is not None:
        vn = rearrange(expand_kv(v.to(dt), n_heads), "b p h d -> b h p d").norm(dim=-1)
        value_ratio = _safe_div((vn * hot).sum(-1), _masked_mean(vn, rest, -1))

    if not bool((qvalid.any(-1)).all()):
        raise ArgumentError("no query in the query set sees both the anchor and another visible key in some "
                            "(batch, head); widen query_mask / key_visible or pick another anchor.",
                            argument="query_mask", value=query_mask, allowed="a query that sees the anchor")
    nm, gm = norm_term.mean(-1), angle_term.mean(-1)
    return QKDecomposition(
        norm_term=norm_term, angle_term=angle_term, advantage=adv,
        norm_share=_share(norm_term, adv), angle_share=_share(angle_term, adv),
        key_norm_ratio=_safe_div(a_star, _masked_mean(a, rest, -1)), key_norm_z=_z_vs_rest(a, hot, rest),
        cos_gap=cos_gap, cos_z=_z_vs_rest(cos_col, hot, rest), value_norm_ratio=value_ratio,
        labels=qk_label(norm_term, angle_term, share), anchor=anc, n_queries=qvalid.sum(-1),
        norm_term_mean=nm, angle_term_mean=gm, advantage_mean=nm + gm,
        norm_share_mean=_share(nm, nm + gm), labels_mean=qk_label(nm, gm, share))


# ----------------------------------------------------------------------------------------------
# paper mode: the AF QK_decomposition.py maps (visual parity only)
# ----------------------------------------------------------------------------------------------

@dataclass
class PaperQKMaps(ResultMixin):
    """The three [batch, query, key] maps of the AF QK figure (NaN above the diagonal when causal).

    ``to_frame()`` columns: ``metric`` (``qk``, ``cos``, ``norm_prod``), ``dim0`` (batch), ``query``, ``key``,
    ``value``.
    """

    qk: Tensor           # q_i·k_j, no 1/√d
    cos: Tensor          # cos θ_ij
    norm_prod: Tensor    # ‖q_i‖‖k_j‖ (column structure is purely ‖k_j‖)

    _dims: ClassVar = {"qk": ("query", "key"), "cos": ("query", "key"), "norm_prod": ("query", "key")}


def _maps(qv: Tensor, kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    qk = einsum(qv, kv, "... i d, ... j d -> ... i j")
    norm_prod = qv.norm(dim=-1)[..., :, None] * kv.norm(dim=-1)[..., None, :]
    return qk, qk / norm_prod.clamp_min(COS_EPS), norm_prod


def _check_maps(q: Any, k: Any, head_avg: Any, head: Any, mode: Any, causal: Any, n_heads: Any) -> tuple:
    validate.tensor(k, name="k", ndim=4, dtype="float", finite=True)
    mode = validate.choice(mode, MODES, name="mode")
    head_avg = validate.boolean(head_avg, name="head_avg")
    validate.boolean(causal, name="causal")
    if q is not None:
        validate.tensor(q, name="q", ndim=4, dtype="float", finite=True)
        if tuple(q.shape[:2]) != tuple(k.shape[:2]) or q.shape[-1] != k.shape[-1]:
            raise ArgumentError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}: expected the same "
                                "batch, positions and d_head.", argument="k", value=k, allowed="matching q")
        kv_head_index(q.shape[2], k.shape[2])
        if n_heads is not None and validate.integer(n_heads, name="n_heads", min=1) != q.shape[2]:
            raise ArgumentError(f"n_heads={n_heads} but q has {q.shape[2]} heads.", argument="n_heads", value=n_heads,
                                allowed=str(q.shape[2]))
        n_heads = q.shape[2]
    elif n_heads is not None:
        n_heads = validate.integer(n_heads, name="n_heads", min=1)
        kv_head_index(n_heads, k.shape[2])
    if not head_avg:
        if head is None:
            raise ArgumentError("head=None is invalid with head_avg=False: pass head=... (a query head).",
                                argument="head", value=None, allowed="an int head")
        if n_heads is not None:
            head = validate.index(head, n_heads, name="head", what="head")
        else:   # no q and no n_heads: the reference takes any head h >= 0 and reads kv head h % H_kv
            if not validate._is_int(head) or int(head) < 0:
                raise OutOfRangeError(f"head={head!r} is invalid without query states: expected an int >= 0 (pass "
                                      "n_heads= to use negative heads).", argument="head", value=head,
                                      allowed="an int >= 0")
            head = int(head)
    elif head is not None:
        raise ArgumentError(f"head={head!r} is ignored with head_avg=True: pass head_avg=False to pick a head.",
                            argument="head", value=head, allowed="None when head_avg=True")
    return mode, head_avg, head, n_heads


def paper_qk_maps(q: Float[Tensor, "batch pos head d"] | None, k: Float[Tensor, "batch pos kv_head d"],
                  head_avg: bool = True, head: int | None = None, mode: Mode = "paper",
                  causal: bool = False, n_heads: int | None = None) -> PaperQKMaps:
    """QK / Cos / NormProd maps as drawn by the AF script — for *visual parity only*.

    ``mode="paper"`` reproduces its numerics, bugs included:
      - ``head_avg``: q is averaged over heads and k over kv heads *as vectors*, then dotted
        (≠ the mean of per-head QK; it mixes unrelated head subspaces);
      - per head: the GQA pairing is kv = h % H_kv (HF uses h // (H/H_kv));
      - ``q=None``: silently uses q := k (K·Kᵀ), per head with k[h % H_kv] for *both* (any head
        h ≥ 0, as the reference; ``n_heads`` bounds it and allows negative heads); we warn.
    ``mode="default"``: ``head_avg`` averages the per-head *maps*; GQA pairing h // rep; q required.
    Both modes: Cos = QK / max(NormProd, 1e-12) as the reference (0, not NaN, for a zero vector).
    ``causal`` masks j > i with NaN (the script's ARM mode).
    """
    mode, head_avg, head, n_heads = _check_maps(q, k, head_avg, head, mode, causal, n_heads)
    k = k.to(torch.float64)
    if q is None:
        if mode != "paper":
            raise ArgumentError("q=None is invalid outside paper mode: query states are required (the reference's "
                                "q := k fallback is a paper-mode quirk).", argument="q", value=None,
                                allowed="a [batch, pos, head, d] tensor")
        warnings.warn("paper_qk_maps: no query states, using q := k as the reference script does", stacklevel=2)
        kv = k.mean(2) if head_avg else k[:, :, head % k.shape[2]]
        qk, cos, norm_prod = _maps(kv, kv)
    else:
        q = q.to(torch.float64)
        if mode == "paper" and head_avg:
            qk, cos, norm_prod = _maps(q.mean(2), k.mean(2))
        else:
            kk = expand_kv(k, n_heads, mode)
            qh, kh = rearrange(q, "b p h d -> b h p d"), rearrange(kk, "b p h d -> b h p d")
            if head_avg:
                qk, cos, norm_prod = (m.mean(1) for m in _maps(qh, kh))
            else:
                qk, cos, norm_prod = _maps(qh[:, head], kh[:, head])
    if causal:
        n = qk.shape[-1]
        upper = ~torch.tril(torch.ones(n, n, dtype=torch.bool, device=qk.device))
        qk, cos, norm_prod = (m.masked_fill(upper, torch.nan) for m in (qk, cos, norm_prod))
    return PaperQKMaps(qk=qk, cos=cos, norm_prod=norm_prod)
