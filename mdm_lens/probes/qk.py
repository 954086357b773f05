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
from typing import ClassVar, Literal

import numpy as np
import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._results import ResultMixin, to_numpy
from .floating import visibility_mask

__all__ = ["kv_head_index", "expand_kv", "decompose", "QKDecomposition", "qk_label",
           "paper_qk_maps", "PaperQKMaps", "QK_LABELS"]

Mode = Literal["default", "paper"]
QK_LABELS: tuple[str, ...] = ("angle-driven", "norm-driven", "combined", "no-advantage")


def kv_head_index(n_heads: int, n_kv_heads: int, mode: Mode = "default") -> Int[Tensor, "head"]:
    """kv head used by each query head: h // (H / H_kv) (HF repeat_kv); ``paper``: h % H_kv (AF bug)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    h = torch.arange(n_heads)
    return h % n_kv_heads if mode == "paper" else h // (n_heads // n_kv_heads)


def expand_kv(k: Float[Tensor, "batch pos kv_head d"], n_heads: int,
              mode: Mode = "default") -> Float[Tensor, "batch pos head d"]:
    """Per-query-head copy of GQA keys/values (``default`` ≡ ``repeat_interleave(rep, dim=2)``)."""
    return k[:, :, kv_head_index(n_heads, k.shape[2], mode).to(k.device)]


def _safe_div(x: Tensor, y: Tensor) -> Tensor:
    return torch.where(y != 0, x / torch.where(y != 0, y, torch.ones_like(y)), torch.full_like(x, torch.nan))


def _masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    # where(), not x*m: entries outside the mask may be NaN (e.g. queries with no reference key)
    return _safe_div(torch.where(mask, x, torch.zeros_like(x)).sum(dim), mask.to(x.dtype).sum(dim))


def _z_vs_rest(col: Tensor, anchor_hot: Tensor, rest: Tensor) -> Tensor:
    """(x_* − mean_R x) / std_R x (population) along the key axis."""
    mu = _masked_mean(col, rest, -1)
    sd = _masked_mean((col - mu[..., None]) ** 2, rest, -1).sqrt()
    star = (col * anchor_hot).sum(-1)
    return _safe_div(star - mu, sd)


def qk_label(norm_term: Tensor, angle_term: Tensor, share: float = 0.8) -> np.ndarray:
    """§3.6 labels: no-advantage if Δ ≤ 0; angle-driven if N ≤ 0 or G/Δ ≥ 0.8; norm-driven if
    N/Δ ≥ 0.8; combined otherwise."""
    n, g = to_numpy(norm_term).astype(float), to_numpy(angle_term).astype(float)
    d = n + g
    with np.errstate(divide="ignore", invalid="ignore"):
        gs, ns = g / d, n / d
    return np.select([~(d > 0), (n <= 0) | (gs >= share), ns >= share],
                     ["no-advantage", "angle-driven", "norm-driven"], default="combined").astype(object)


@dataclass
class QKDecomposition(ResultMixin):
    """Per (batch, head) decomposition Δ = N + G of the anchor's mean QK logit advantage, plus head means."""

    norm_term: Tensor            # [batch, head]  N
    angle_term: Tensor           # [batch, head]  G
    advantage: Tensor            # [batch, head]  Δ = N + G
    norm_share: Tensor           # [batch, head]  N/Δ
    angle_share: Tensor          # [batch, head]  G/Δ
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
              v: Float[Tensor, "batch pos kv_head d"] | None = None, share: float = 0.8) -> QKDecomposition:
    """Shapley norm/angle split of the anchor key's QK advantage, per head (§3.6).

    N = (1/√d) mean_{i∈Q'} mean_{j∈R_i} (a* − a_j)(b_i* + b_ij)/2,
    G = (1/√d) mean_{i∈Q'} mean_{j∈R_i} (b_i* − b_ij)(a* + a_j)/2,
    Δ = N + G = (1/√d) mean_i mean_{j∈R_i} (q_i·k* − q_i·k_j).

    R_i = keys visible to i (``key_visible``, ``causal``) other than j*; Q' = the query set (default
    the visible positions) restricted to queries that see j* and have R_i ≠ ∅.
    Unbatched ``[pos, head, d]`` inputs are accepted.
    """
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
    vis = visibility_mask(n_pos, n_pos, kv_vis, causal, device=q.device).expand(batch, n_heads, n_pos, n_pos)
    anc = torch.as_tensor(anchor, device=q.device).long()
    anc = (anc[:, None] if anc.ndim == 1 else anc).expand(batch, n_heads)
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

    nm, gm = norm_term.mean(-1), angle_term.mean(-1)
    return QKDecomposition(
        norm_term=norm_term, angle_term=angle_term, advantage=adv,
        norm_share=_safe_div(norm_term, adv), angle_share=_safe_div(angle_term, adv),
        key_norm_ratio=_safe_div(a_star, _masked_mean(a, rest, -1)), key_norm_z=_z_vs_rest(a, hot, rest),
        cos_gap=cos_gap, cos_z=_z_vs_rest(cos_col, hot, rest), value_norm_ratio=value_ratio,
        labels=qk_label(norm_term, angle_term, share), anchor=anc, n_queries=qvalid.sum(-1),
        norm_term_mean=nm, angle_term_mean=gm, advantage_mean=nm + gm,
        norm_share_mean=_safe_div(nm, nm + gm), labels_mean=qk_label(nm, gm, share))


# ----------------------------------------------------------------------------------------------
# paper mode: the AF QK_decomposition.py maps (visual parity only)
# ----------------------------------------------------------------------------------------------

@dataclass
class PaperQKMaps(ResultMixin):
    """The three [batch, query, key] maps of the AF QK figure (NaN above the diagonal when causal)."""

    qk: Tensor           # q_i·k_j, no 1/√d
    cos: Tensor          # cos θ_ij
    norm_prod: Tensor    # ‖q_i‖‖k_j‖ (column structure is purely ‖k_j‖)

    _dims: ClassVar = {"qk": ("query", "key"), "cos": ("query", "key"), "norm_prod": ("query", "key")}


def _maps(qv: Tensor, kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    qk = einsum(qv, kv, "... i d, ... j d -> ... i j")
    norm_prod = qv.norm(dim=-1)[..., :, None] * kv.norm(dim=-1)[..., None, :]
    return qk, _safe_div(qk, norm_prod), norm_prod


def paper_qk_maps(q: Float[Tensor, "batch pos head d"] | None, k: Float[Tensor, "batch pos kv_head d"],
                  head_avg: bool = True, head: int | None = None, mode: Mode = "paper",
                  causal: bool = False) -> PaperQKMaps:
    """QK / Cos / NormProd maps as drawn by the AF script — for *visual parity only*.

    ``mode="paper"`` reproduces its numerics, bugs included:
      - ``head_avg``: q is averaged over heads and k over kv heads *as vectors*, then dotted
        (≠ the mean of per-head QK; it mixes unrelated head subspaces);
      - per head: the GQA pairing is kv = h % H_kv (HF uses h // (H/H_kv));
      - ``q=None``: silently uses q := k (K·Kᵀ); we warn.
    ``mode="default"``: ``head_avg`` averages the per-head *maps*; GQA pairing h // rep; q required.
    ``causal`` masks j > i with NaN (the script's ARM mode).
    """
    if q is None:
        if mode != "paper":
            raise ValueError("query states are required outside paper mode")
        warnings.warn("paper_qk_maps: no query states, using q := k as the reference script does", stacklevel=2)
        q = k
    q, k = q.to(torch.float64), k.to(torch.float64)
    n_heads = q.shape[2]
    if mode == "paper" and head_avg:
        qk, cos, norm_prod = _maps(q.mean(2), k.mean(2))
    else:
        kk = expand_kv(k, n_heads, mode) if k.shape[2] != n_heads or mode == "paper" else k
        qh, kh = rearrange(q, "b p h d -> b h p d"), rearrange(kk, "b p h d -> b h p d")
        if head_avg:
            qk, cos, norm_prod = (m.mean(1) for m in _maps(qh, kh))
        else:
            if head is None:
                raise ValueError("pass head=... when head_avg=False")
            qk, cos, norm_prod = _maps(qh[:, head], kh[:, head])
    if causal:
        n = qk.shape[-1]
        upper = ~torch.tril(torch.ones(n, n, dtype=torch.bool, device=qk.device))
        qk, cos, norm_prod = (m.masked_fill(upper, torch.nan) for m in (qk, cos, norm_prod))
    return PaperQKMaps(qk=qk, cos=cos, norm_prod=norm_prod)
