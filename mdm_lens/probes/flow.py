"""Region-level attention flow: regions, token-level rollout, pooling, diagnostics (§1.e, §3.8).

Default pipeline: token-level rollout R = Ã^L ⋯ Ã^1 with Ã^l = rownorm((1−w)·Ā^l + w·I)
(Abnar & Zuidema, residual w = 0.5, i.e. (Ā + I)/2 for row-stochastic Ā), *then* pooling onto
regions F_ab = mean_{r∈R_a} Σ_{c∈R_b} R[r, c] (row mean, column sum: rows stay stochastic).
Pooling and rollout do not commute, which is why the order is fixed here.

Two artefacts are diagnosed on every result (see §1.e):
- rank-one collapse: products of many positive stochastic matrices converge to one row (the chain's
  stationary distribution), so "Answer → Gold" becomes indistinguishable from "BOS → Gold";
- causal BOS absorption: under a causal mask row 0 is e_0 in every layer, so BOS is an absorbing
  state and the rollout of *any* causal attention ends up on BOS.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

from . import _checks as C
from ._ignored import refuse_ignored
from ._results import ResultMixin

__all__ = ["Region", "CharSpan", "REGION_KINDS", "AF_KINDS", "complete_regions", "regions_from_char_spans",
           "paper_region_shift", "assignment_matrix", "pool", "sum_pool", "rownorm", "rollout", "flow",
           "FlowResult", "FlowDiagnosticWarning", "RolloutCollapseWarning", "BOSAbsorbingWarning"]

RegionKind = Literal["bos", "template", "query", "doc", "gold", "answer", "other", "pad"]
REGION_KINDS: tuple[str, ...] = ("bos", "template", "query", "doc", "gold", "answer", "other", "pad")
AF_KINDS: tuple[str, ...] = ("bos", "query", "doc", "gold", "answer")   # the regions the AF script keeps


class FlowDiagnosticWarning(UserWarning):
    """Base class of the flow diagnostics' warnings."""


class RolloutCollapseWarning(FlowDiagnosticWarning):
    """Pooled rollout rows are (numerically) identical: the result no longer depends on the source."""


class BOSAbsorbingWarning(FlowDiagnosticWarning):
    """Causal rollout sent (almost) all mass to BOS — an absorbing state of any causal chain."""


# ----------------------------------------------------------------------------------------------
# regions
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """Half-open token span [start, end) with a name and a kind (``REGION_KINDS``)."""

    name: str
    start: int
    end: int
    kind: RegionKind = "other"

    def __post_init__(self):
        _check_span(self)

    def __len__(self) -> int:
        return self.end - self.start


def _check_span(span: Any) -> None:
    what = type(span).__name__
    if not isinstance(span.name, str):
        raise ArgumentTypeError(f"{what}.name={span.name!r} is invalid: expected a str.", argument="name",
                                value=span.name, allowed="a str")
    validate.choice(span.kind, REGION_KINDS, name="kind")
    start = validate.integer(span.start, name="start", min=0)
    validate.integer(span.end, name="end", min=start)


@dataclass(frozen=True)
class CharSpan:
    """Half-open *character* span [start, end) of the prompt string, to be mapped to tokens."""

    name: str
    start: int
    end: int
    kind: RegionKind = "other"

    def __post_init__(self):
        _check_span(self)


def _regions(regions: Any, name: str = "regions") -> list[Region]:
    return validate.instances(regions, Region, name=name)


def _check_disjoint(regions: Sequence[Region], T: int) -> list[Region]:
    regs = sorted(_regions(regions), key=lambda r: r.start)
    T = validate.integer(T, name="T", min=1)
    for r in regs:
        if not 0 <= r.start < r.end <= T:
            raise ArgumentError(f"regions: {r} is empty or outside [0, {T}): expected 0 <= start < end <= {T}.",
                                argument="regions", value=r, allowed=f"non-empty spans within [0, {T})")
    for a, b in zip(regs, regs[1:]):
        if b.start < a.end:
            raise ArgumentError(f"regions overlap: {a} and {b}; expected disjoint spans.", argument="regions",
                                value=[a, b], allowed="disjoint spans")
    return regs


def complete_regions(regions: Sequence[Region], T: int) -> list[Region]:
    """Sort, validate (non-empty, in range, disjoint) and fill every gap with an ``other`` region,
    so the result partitions [0, T) and no token is dropped."""
    out: list[Region] = []
    pos, n_other = 0, 0
    for r in _check_disjoint(regions, T) + [Region("_end", T, T + 1)]:
        if r.start > pos:
            n_other += 1
            out.append(Region("other" if n_other == 1 else f"other_{n_other}", pos, r.start, "other"))
        if r.name != "_end":
            out.append(r)
        pos = r.end
    return _unique_names(out)


def _unique_names(regions: list[Region]) -> list[Region]:
    seen: dict[str, int] = {}
    out = []
    for r in regions:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(r if seen[r.name] == 1 else Region(f"{r.name}#{seen[r.name]}", r.start, r.end, r.kind))
    return out


def regions_from_char_spans(spans: Sequence[CharSpan], offsets: Sequence[tuple[int, int]],
                            pad_mask: Sequence[bool] | None = None, bos_first_empty: bool = True) -> list[Region]:
    """Token regions from character spans and the per-token ``(char_start, char_end)`` offsets of
    *one joint tokenisation* (HF ``return_offsets_mapping``) — never re-tokenised substrings.

    Each token goes to the span it overlaps most (first on ties).  Tokens with an empty offset
    (specials): the first one becomes ``bos`` if ``bos_first_empty``, ``pad_mask`` ones become
    ``pad``, the rest ``other``; tokens overlapping no span are ``other``.  Consecutive tokens with
    the same assignment form one region; the result covers every token.
    """
    spans = validate.instances(spans, CharSpan, name="spans")
    offsets = _offsets(offsets)
    bos_first_empty = validate.boolean(bos_first_empty, name="bos_first_empty")
    if pad_mask is not None:
        if isinstance(pad_mask, (str, bytes)) or len(pad_mask) != len(offsets):
            raise ArgumentError(f"pad_mask has {len(pad_mask)} entries but there are {len(offsets)} tokens.",
                                argument="pad_mask", value=pad_mask, allowed=f"{len(offsets)} bools")
        pad_mask = [validate.boolean(bool(p) if isinstance(p, Tensor) else p, name=f"pad_mask[{i}]")
                    for i, p in enumerate(pad_mask)]
    labels: list[tuple[str, str]] = []
    for t, (s, e) in enumerate(offsets):
        if pad_mask is not None and pad_mask[t]:
            labels.append(("pad", "pad"))
        elif s >= e:
            labels.append(("bos", "bos") if t == 0 and bos_first_empty else ("other", "other"))
        else:
            best, best_ov = None, 0
            for sp in spans:
                ov = min(e, sp.end) - max(s, sp.start)
                if ov > best_ov:
                    best, best_ov = sp, ov
            labels.append((best.name, best.kind) if best is not None else ("other", "other"))
    regions, start = [], 0
    for t in range(1, len(labels) + 1):
        if t == len(labels) or labels[t] != labels[start]:
            regions.append(Region(labels[start][0], start, t, labels[start][1]))  # type: ignore[arg-type]
            start = t
    n_other = 0
    renamed = []
    for r in regions:   # number the "other" runs so every region name is unique
        if r.kind == "other" and r.name == "other":
            n_other += 1
            r = Region("other" if n_other == 1 else f"other_{n_other}", r.start, r.end, "other")
        renamed.append(r)
    return _unique_names(renamed)


def _offsets(offsets: Any) -> list[tuple[int, int]]:
    if isinstance(offsets, Tensor):
        offsets = offsets.tolist()
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence) or not offsets:
        raise ArgumentTypeError(f"offsets={validate.describe(offsets)} is invalid: expected a non-empty list of "
                                "(char_start, char_end) pairs, one per token.", argument="offsets", value=offsets,
                                allowed="[(start, end), ...]")
    out = []
    for t, pair in enumerate(offsets):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ArgumentTypeError(f"offsets[{t}]={pair!r} is invalid: expected a (char_start, char_end) pair.",
                                    argument=f"offsets[{t}]", value=pair, allowed="(start, end)")
        s = validate.integer(pair[0], name=f"offsets[{t}][0]", min=0)
        out.append((s, validate.integer(pair[1], name=f"offsets[{t}][1]", min=s)))
    return out


def paper_region_shift(regions: Sequence[Region], keep: Sequence[str] = ("bos", "answer", "pad")) -> list[Region]:
    """AF boundary reconstruction: the script re-tokenises ``"Query: ..."`` without specials and puts
    Query at [1, L_q) although the sequence is BOS + L_q tokens, so every boundary after BOS moves
    left by one (Answer comes from ``input_len`` and is not shifted).  Regions of kinds in ``keep``
    are unchanged; others become [max(start−1, bos_end), end−1); emptied regions disappear."""
    regions = _regions(regions)
    if isinstance(keep, str) or not isinstance(keep, Sequence):
        raise ArgumentTypeError(f"keep={keep!r} is invalid: expected a list of region kinds.", argument="keep",
                                value=keep, allowed=f"kinds from {REGION_KINDS}")
    keep = [validate.choice(k, REGION_KINDS, name=f"keep[{i}]") for i, k in enumerate(keep)]
    bos_end = max((r.end for r in regions if r.kind == "bos"), default=0)
    out = []
    for r in regions:
        if r.kind in keep:
            out.append(r)
        else:
            s, e = max(r.start - 1, bos_end), r.end - 1
            if e > s:
                out.append(Region(r.name, s, e, r.kind))
    return out


# ----------------------------------------------------------------------------------------------
# pooling and rollout
# ----------------------------------------------------------------------------------------------

def assignment_matrix(regions: Sequence[Region], T: int, dtype=torch.float64, device=None) -> Float[Tensor, "token region"]:
    """One-hot P[t, a] = 1 iff token t ∈ R_a (regions within [0, T), disjoint, possibly not covering)."""
    _check_disjoint(regions, T)
    P = torch.zeros(T, len(regions), dtype=dtype, device=device)
    for a, r in enumerate(regions):
        P[r.start:r.end, a] = 1
    return P


def sum_pool(M: Float[Tensor, "... query key"], regions: Sequence[Region]) -> Float[Tensor, "... src dst"]:
    """AF pooling P_ab = Σ_{r∈R_a} Σ_{c∈R_b} M[r, c] (tokens outside the regions are ignored)."""
    _matrix(M, "M")
    P = assignment_matrix(regions, M.shape[-1], M.dtype, M.device)
    return einsum(M, P, P, "... r c, r a, c b -> ... a b")


def pool(M: Float[Tensor, "... query key"], regions: Sequence[Region]) -> Float[Tensor, "... src dst"]:
    """F_ab = mean_{r∈R_a} Σ_{c∈R_b} M[r, c]; for a partition and row-stochastic M, Σ_b F_ab = 1."""
    _matrix(M, "M")
    sizes = torch.tensor([len(r) for r in regions], dtype=M.dtype, device=M.device)
    return sum_pool(M, regions) / sizes[:, None]


def _matrix(M: Any, name: str, min_ndim: int = 2) -> None:
    """A finite, non-negative, square float tensor (attention or a rollout)."""
    C.float_tensor(M, name=name, min_ndim=min_ndim, square=True)
    C.finite_where(M, None, name=name)
    if bool((M < 0).any()):
        raise ArgumentError(f"{name} has negative entries (min {float(M.min()):.3g}): expected attention weights "
                            ">= 0.", argument=name, value=M, allowed="values >= 0")


def rownorm(M: Float[Tensor, "... n n"]) -> Float[Tensor, "... n n"]:
    """Divide each row by its sum (zero rows stay zero)."""
    _matrix(M, "M")
    s = M.sum(-1, keepdim=True)
    return M / torch.where(s > 0, s, torch.ones_like(s))


def rollout(attn: Float[Tensor, "... layer query key"], residual: float = 0.5) -> Float[Tensor, "... layer query key"]:
    """Partial rollouts R^(l) = Ã^l ⋯ Ã^1, Ã^l = rownorm((1 − residual)·Ā^l + residual·I).

    ``attn`` is the head-mean attention per layer; entry l of the output is the rollout up to and
    including layer l (the last one is the full rollout).
    """
    _matrix(attn, "attn", min_ndim=3)
    residual = validate.number(residual, name="residual", min=0, max=1)
    A = attn.to(torch.float64)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    out, R = [], None
    for layer in range(A.shape[-3]):
        At = rownorm((1 - residual) * A[..., layer, :, :] + residual * eye)
        R = At if R is None else At @ R
        out.append(R)
    return torch.stack(out, -3)


# ----------------------------------------------------------------------------------------------
# flow
# ----------------------------------------------------------------------------------------------

@dataclass
class FlowResult(ResultMixin):
    """Pooled flow between regions (rows = source/query side, columns = destination/key side).

    ``to_frame()`` columns: ``metric`` (a field name), any leading dims, ``layer`` (for the ``*_by_layer`` and
    ``layer_flow`` fields), ``src`` / ``dst`` (region names), ``value``, ``label``.  ``notes`` lists what
    paper mode dropped.
    """

    regions: list[Region]
    mode: str
    causal: bool
    flow: Tensor                 # [..., src, dst]          pooled full rollout
    flow_by_layer: Tensor        # [..., layer, src, dst]   pooled partial rollouts
    layer_flow: Tensor           # [..., layer, src, dst]   pooled raw attention per layer (no rollout)
    answer_row: Tensor           # [..., dst]               F_{Answer, ·}
    answer_row_by_layer: Tensor  # [..., layer, dst]
    answer_density: Tensor       # [..., dst]               F_{A,b} / (|R_b| / T)
    answer_no_bos: Tensor        # [..., dst]               answer row with BOS removed, renormalised
    gold_ratio: Tensor           # [...]                    F_{A,gold} / mean_d F_{A,d}
    gold_ratio_density: Tensor   # [...]                    same on the density-normalised row
    row_spread: Tensor           # [...]                    max_{a,b,c} |F_ac − F_bc|
    bos_share: Tensor            # [...]                    mean over token rows of rollout mass on BOS
    bos_absorbing: Tensor        # [...] bool               causal and bos_share ≥ bos_tol
    notes: list[str] = field(default_factory=list)

    _dims: ClassVar = {
        "flow": ("src", "dst"), "flow_by_layer": ("layer", "src", "dst"), "layer_flow": ("layer", "src", "dst"),
        "answer_row": ("dst",), "answer_row_by_layer": ("layer", "dst"), "answer_density": ("dst",),
        "answer_no_bos": ("dst",), "gold_ratio": (), "gold_ratio_density": (), "row_spread": (),
        "bos_share": (), "bos_absorbing": ()}

    def _coords(self):
        names = [r.name for r in self.regions]
        return {"src": names, "dst": names}


def _ratio(row: Tensor, gold: list[int], docs: list[int]) -> Tensor:
    if not gold or not docs:
        return torch.full(row.shape[:-1], torch.nan, dtype=row.dtype)
    return row[..., gold].mean(-1) / row[..., docs].mean(-1)


def flow(attn: Float[Tensor, "... layer query key"], regions: Sequence[Region], causal: bool = False,
         mode: Literal["default", "paper"] = "default", residual: float = 0.5,
         collapse_tol: float = 1e-4, bos_tol: float = 0.9, warn: bool = True) -> FlowResult:
    """Region flow from per-layer head-mean attention ``[..., layer, T, T]`` (§3.8).

    ``default``: regions are completed to a partition (gaps → ``other``), token-level rollout, then
    mean/sum pooling F_ab = mean_{r∈R_a} Σ_{c∈R_b} R[r, c]; answer row = pooled over all ``answer``
    tokens.  ``paper`` (AF): only the AF region kinds are kept (other tokens dropped), each layer is
    sum-pooled and row-normalised, region-level rollout rownorm(P + I), product, row-normalised.

    Gold ratio: mean over ``gold`` regions / mean over ``doc`` regions of the answer row (NaN if
    either is missing).  Diagnostics: ``row_spread`` < collapse_tol → :class:`RolloutCollapseWarning`;
    causal with BOS share ≥ bos_tol → ``bos_absorbing`` and :class:`BOSAbsorbingWarning`.
    """
    _matrix(attn, "attn", min_ndim=3)
    regions = _regions(regions)
    causal = validate.boolean(causal, name="causal")
    mode = validate.choice(mode, ("default", "paper"), name="mode")
    residual = validate.number(residual, name="residual", min=0, max=1)
    if mode == "paper":
        refuse_ignored("residual", residual, 0.5, by="mode", by_value="paper", why="the AF rollout is "
                       "rownorm(P + I), i.e. residual 0.5")
    collapse_tol = validate.number(collapse_tol, name="collapse_tol", min=0)
    bos_tol = validate.number(bos_tol, name="bos_tol", min=0, max=1)
    warn = validate.boolean(warn, name="warn")
    A = attn.to(torch.float64)
    T = A.shape[-1]
    notes: list[str] = []
    if mode == "default":
        regs = complete_regions(regions, T)
        R_tok = rollout(A, residual)                                       # [..., L, T, T]
        flow_by_layer = pool(R_tok, regs)
        layer_flow = pool(A, regs)
        ans_tok = torch.zeros(T, dtype=torch.float64, device=A.device)  # attention may live on an accelerator
        for r in regs:
            if r.kind == "answer":
                ans_tok[r.start:r.end] = 1
        P = assignment_matrix(regs, T, device=A.device)
        if ans_tok.sum() > 0:
            ans_by_layer = einsum(ans_tok / ans_tok.sum(), R_tok, P, "r, ... l r c, c b -> ... l b")
        else:
            ans_by_layer = torch.full(flow_by_layer.shape[:-1], torch.nan, dtype=torch.float64, device=A.device)
        bos_tok = [t for r in regs if r.kind == "bos" for t in range(r.start, r.end)] or [0]
        bos_share = R_tok[..., -1, :, :][..., bos_tok].sum(-1).mean(-1)
    elif mode == "paper":
        regs = [r for r in _check_disjoint(regions, T) if r.kind in AF_KINDS]
        dropped = T - sum(len(r) for r in regs)
        if dropped:
            notes.append(f"paper mode dropped {dropped} tokens outside the AF regions")
        layer_flow = rownorm(sum_pool(A, regs))                            # [..., L, n, n]
        n = len(regs)
        flow_by_layer = rownorm(rollout(layer_flow, residual=0.5))          # rownorm(P + I) ≡ (P + I)/2
        ans = [a for a, r in enumerate(regs) if r.kind == "answer"]
        ans_by_layer = (flow_by_layer[..., ans, :].mean(-2) if ans
                        else torch.full(flow_by_layer.shape[:-1], torch.nan, dtype=torch.float64, device=A.device))
        bos_reg = [a for a, r in enumerate(regs) if r.kind == "bos"] or [0]
        bos_share = flow_by_layer[..., -1, :, :][..., bos_reg].sum(-1).mean(-1) if n else torch.tensor(torch.nan)
    else:
        raise ValueError(f"unknown mode {mode!r}")

    F = flow_by_layer[..., -1, :, :]
    answer_row = ans_by_layer[..., -1, :]
    sizes = torch.tensor([len(r) for r in regs], dtype=torch.float64, device=A.device)
    density = answer_row / (sizes / sizes.sum())
    is_bos = torch.tensor([r.kind == "bos" for r in regs], device=A.device)
    no_bos = answer_row.masked_fill(is_bos, 0)
    no_bos = (no_bos / no_bos.sum(-1, keepdim=True)).masked_fill(is_bos, torch.nan)
    gold = [a for a, r in enumerate(regs) if r.kind == "gold"]
    docs = [a for a, r in enumerate(regs) if r.kind == "doc"]
    spread = (F.amax(-2) - F.amin(-2)).amax(-1) if len(regs) > 1 else torch.zeros(F.shape[:-2], dtype=F.dtype, device=F.device)
    bos_absorbing = torch.as_tensor(bos_share >= bos_tol) & causal

    if warn and len(regs) > 1 and bool((spread < collapse_tol).any()):
        warnings.warn(f"rollout rows collapsed to rank one (row spread {float(spread.min()):.2e} < {collapse_tol}): "
                      "the flow no longer depends on the source region", RolloutCollapseWarning, stacklevel=2)
    if warn and bool(bos_absorbing.any()):
        warnings.warn(f"causal rollout puts {float(bos_share.max()):.3f} of the mass on BOS, an absorbing state "
                      "of any causal attention chain; see answer_no_bos", BOSAbsorbingWarning, stacklevel=2)
    return FlowResult(
        regions=list(regs), mode=mode, causal=causal, flow=F, flow_by_layer=flow_by_layer, layer_flow=layer_flow,
        answer_row=answer_row, answer_row_by_layer=ans_by_layer, answer_density=density, answer_no_bos=no_bos,
        gold_ratio=_ratio(answer_row, gold, docs), gold_ratio_density=_ratio(density, gold, docs),
        row_spread=spread, bos_share=bos_share, bos_absorbing=bos_absorbing, notes=notes)
