"""Received attention and the share of it that a key set absorbs (spec §3.1, §1.b / §3.3).

The measuring half of the floating-token probes: masks (which keys a query sees), received attention
per key, the uniform-attention baseline, and Absorb(S).  Anchor *detection* (which keys are anchors) is
:mod:`mdm_lens.probes.floating`, which re-exports everything here; :mod:`mdm_lens.probes.drift` builds on
this module only, so the two never import each other.

Axis conventions (TransformerLens): attention patterns are ``[..., query, key]`` with rows summing
to 1 over the keys visible to that query; received attention is ``[..., key]``; per-step series are
``[..., step, key]``.  Visibility: key ``j`` is visible to query ``i`` iff ``key_visible[j]`` (False =
padding) and, when ``causal``, ``j <= i``; with ``block_length=B`` (block diffusion: LLaDA2.x, SDAR, blocks
aligned at position 0) iff ``j // B <= i // B``.  Invisible keys never receive attention here: under a block mask
the ``visibility`` kind averages a key's attention over the queries that can see it, and the uniform null gives each
query ``1/|V_i|`` over its own visible keys.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

from . import _checks as C

__all__ = ["align_mask", "visibility_mask", "uniform_pattern", "received_attention", "uniform_received",
           "absorption", "KINDS"]

Kind = Literal["mass", "visibility", "cumulative"]
KINDS: tuple[str, ...] = ("mass", "visibility", "cumulative")

# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------

def align_mask(mask: Tensor, ndim: int, batch_dim: int | None = None) -> Tensor:
    """Insert singleton axes so ``mask [b0, ..., key]`` broadcasts against an ``ndim``-axis tensor.

    The mask's leading axes are placed starting at ``batch_dim`` of the target and its last axis at
    the target's last axis, e.g. ``[batch, key]`` against ``[step, batch, layer, head, key]`` with
    ``batch_dim=1`` becomes ``[1, batch, 1, 1, key]``.  ``batch_dim=None``: right-aligned (unchanged).
    """
    validate.tensor(mask, name="mask", nonempty=False)
    if mask.ndim == 0:
        raise ArgumentError("mask is a 0-d tensor: expected at least a key axis.", argument="mask", value=mask,
                            allowed=">= 1 dimension")
    ndim = validate.integer(ndim, name="ndim", min=mask.ndim)
    if batch_dim is None or mask.ndim == ndim:
        return mask
    batch_dim = validate.index(batch_dim, ndim, name="batch_dim", what="axis")
    lead = mask.shape[:-1]
    after = ndim - 1 - batch_dim - len(lead)
    if after < 0:
        raise ArgumentError(f"mask of shape {tuple(mask.shape)} does not fit {ndim} axes at batch_dim={batch_dim}: "
                            f"expected batch_dim <= {ndim - mask.ndim}.", argument="batch_dim", value=batch_dim,
                            allowed=f"[0, {ndim - mask.ndim}]")
    return mask.reshape((1,) * batch_dim + tuple(lead) + (1,) * after + (mask.shape[-1],))


def visibility_mask(n_query: int, n_key: int, key_visible: Bool[Tensor, "... key"] | None = None,
                    causal: bool = False, device=None, block_length: int | None = None) -> Bool[Tensor, "... query key"]:
    """V[i, j] = key_visible[j] and (not causal or j <= i + n_key - n_query) and, with ``block_length`` B,
    j // B <= (i + n_key - n_query) // B (block-causal, blocks aligned at key position 0).

    The offset makes the last query see every key, as for a KV-cached suffix of queries.
    """
    n_query = validate.integer(n_query, name="n_query", min=1)
    n_key = validate.integer(n_key, name="n_key", min=1)
    key_visible = C.mask(key_visible, name="key_visible", size=n_key)
    causal = validate.boolean(causal, name="causal")
    if key_visible is not None:
        device = key_visible.device
    vis = torch.ones(n_query, n_key, dtype=torch.bool, device=device)
    if causal:
        vis = torch.tril(vis, diagonal=n_key - n_query)
    if block_length is not None:
        b = validate.integer(block_length, name="block_length", min=1)
        q_block = (torch.arange(n_query, device=device) + n_key - n_query) // b
        vis = vis & ((torch.arange(n_key, device=device) // b)[None, :] <= q_block[:, None])
    if key_visible is not None:
        vis = vis & key_visible[..., None, :]
    return vis


def uniform_pattern(n: int, causal: bool = False, key_visible: Bool[Tensor, "... key"] | None = None,
                    dtype=torch.float64, block_length: int | None = None) -> Float[Tensor, "... query key"]:
    """Uniform attention under the given visibility: A[i, j] = 1/|V_i| for j in V_i (0 for empty rows)."""
    vis = visibility_mask(n, n, key_visible, causal, block_length=block_length).to(dtype)
    return vis / vis.sum(-1, keepdim=True).clamp_min(1)


def _default_query_mask(n_query: int, n_key: int, key_visible: Tensor | None) -> Tensor | None:
    # Default query set = all non-pad positions (spec §3 conventions), i.e. the visible keys when the
    # pattern is square; otherwise all rows.
    if key_visible is not None and n_query == n_key:
        return key_visible
    return None


# ----------------------------------------------------------------------------------------------
# §3.1 received attention
# ----------------------------------------------------------------------------------------------

def _check_probabilities(pattern: Tensor, used: Tensor) -> None:
    """An attention pattern holds probabilities: in [0, 1], each row summing to at most 1 over the keys it uses.
    Scores (`hook_attn_scores`) or a sum of heads would give "mass" outside [0, 1]: refused, not reduced."""
    vals = pattern[used]
    if vals.numel() == 0:
        return
    # a bf16 / fp16 pattern (even upcast) is rounded to ~1e-2 per entry; a wrong input (scores, a sum over heads:
    # row sums of n_heads) is off by far more
    tol = 0.05
    row = torch.where(used, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device)).sum(-1)
    if bool(vals.min() < -tol) or bool(vals.max() > 1 + tol) or bool(row.max() > 1 + tol):
        raise ArgumentError(f"pattern holds values in [{float(vals.min()):.3g}, {float(vals.max()):.3g}] with row sums "
                            f"up to {float(row.max()):.3g}: not attention probabilities (pass hook_pattern, or a "
                            "head mean of it, not hook_attn_scores or a sum over heads).", argument="pattern",
                            value=tuple(pattern.shape), allowed="probabilities: entries in [0, 1], rows summing to <= 1")


HIDDEN_MASS_TOL = 1e-3  # a masked softmax puts exactly 0 there in any dtype; 1e-3 leaves room for additive masks


def _check_hidden_mass(pattern: Tensor, q: Tensor, key_visible: Tensor | None, causal: bool,
                       block_length: int | None) -> None:
    """The declared mask (``causal`` / ``block_length``) must be the pattern's own: mass a used query row puts on
    a key the mask hides would be dropped silently (the result no longer a distribution), so it is refused, as
    row sums > 1 are. Padding keys (``key_visible`` False) are aside: an unmasked pattern's mass there is ignored
    by design."""
    if not causal and block_length is None:
        return
    n_q, n_k = pattern.shape[-2:]
    hidden = ~visibility_mask(n_q, n_k, None, causal, device=pattern.device, block_length=block_length)
    hidden = hidden & q[..., :, None]
    if key_visible is not None:
        hidden = hidden & key_visible[..., None, :]
    hidden = hidden & torch.isfinite(pattern)
    mass = torch.where(hidden, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device)).sum(-1)
    worst = float(mass.max()) if mass.numel() else 0.0
    if worst > HIDDEN_MASS_TOL:
        declared = " and ".join(([f"block_length={block_length}"] if block_length is not None else [])
                                + (["causal=True"] if causal else []))
        arg = "block_length" if block_length is not None else "causal"
        raise ArgumentError(f"pattern puts up to {worst:.3g} of a query row's mass on keys that {declared} hides: the "
                            "declared mask is not the pattern's own, and that mass would be dropped silently. Pass the "
                            "mask the model used (bidirectional: causal=False, no block_length; block diffusion: its "
                            "block size).", argument=arg, value=block_length if arg == "block_length" else causal,
                            allowed=f"a mask under which used rows carry at most {HIDDEN_MASS_TOL:g} hidden mass")


def received_attention(pattern: Float[Tensor, "... query key"],
                       query_mask: Bool[Tensor, "... query"] | None = None,
                       key_visible: Bool[Tensor, "... key"] | None = None,
                       kind: Kind = "mass", causal: bool = False,
                       nan_policy: str = "raise", block_length: int | None = None) -> Float[Tensor, "... key"]:
    """Attention received by each key, reduced over a query set Q (default: all non-pad rows).

    - ``mass``:       m_j = (1/|Q|) Σ_{i∈Q} A_ij            (AF's A^l_j; Σ_j m_j = 1 when Q = all rows)
    - ``visibility``: r_j = (1/|Q_j|) Σ_{i∈Q_j} A_ij, Q_j = {i ∈ Q : j ∈ V_i}   (Gu's α; = m_j when
      every query sees every key, i.e. bidirectional); 0 where Q_j is empty
    - ``cumulative``: α_j = Σ_{i∈Q} A_ij                    (Rulli / SAP column sum)

    ``causal`` and ``block_length`` (block-causal) only matter for ``visibility`` (which queries can see j); entries at
    padding keys are ignored, so unmasked patterns with mass (or NaN) on padding do not leak into m_j, but a used row
    with more than ``HIDDEN_MASS_TOL`` of mass on keys ``causal`` / ``block_length`` hide raises ``ArgumentError``
    (the declared mask is not the pattern's).  NaN/inf at a used entry raises ``NonFiniteError``
    (``nan_policy="omit"``: such entries count as 0).  An empty query set raises for ``mass`` / ``visibility`` (a mean over no rows is undefined).
    """
    pattern = C.float_tensor(pattern, name="pattern", min_ndim=2)
    n_q, n_k = pattern.shape[-2:]
    query_mask = C.mask(query_mask, name="query_mask", size=n_q, against=pattern.shape[:-1])
    key_visible = C.mask(key_visible, name="key_visible", size=n_k, against=pattern.shape[:-2] + (n_k,))
    kind = validate.choice(kind, KINDS, name="kind")
    causal = validate.boolean(causal, name="causal")
    policy = C.nan_policy(nan_policy)
    vis = visibility_mask(n_q, n_k, key_visible, causal, device=pattern.device, block_length=block_length)
    if query_mask is None:
        query_mask = _default_query_mask(n_q, n_k, key_visible)
    q = torch.ones(n_q, dtype=torch.bool, device=pattern.device) if query_mask is None else query_mask
    used = vis & q[..., :, None]
    C.finite_where(pattern, used, name="pattern", policy=policy)
    used = used & torch.isfinite(pattern)
    _check_probabilities(pattern, used)
    _check_hidden_mass(pattern, q, key_visible, causal, block_length)
    a = torch.where(used, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device))
    col = a.sum(-2)                                                         # Σ_{i∈Q} A_ij
    if kind == "cumulative":
        return col
    n_rows = q.to(pattern.dtype).sum(-1, keepdim=True)                      # |Q|
    if bool((n_rows == 0).any()):
        raise ArgumentError("the query set is empty in some series (query_mask / key_visible select no query "
                            "row), so a mean over queries is undefined.", argument="query_mask",
                            value=query_mask, allowed="at least one query row per series")
    if kind == "mass":
        return col / n_rows
    n_seen = (vis & q[..., :, None]).to(pattern.dtype).sum(-2)              # |Q_j|
    return torch.where(n_seen > 0, col / n_seen.clamp_min(1), torch.zeros_like(col))


def _harmonic(n: Tensor) -> Tensor:
    """H_n = Σ_{k=1}^{n} 1/k for integer tensors (float64), H_0 = 0; exact summation."""
    n = n.long()
    m = max(int(n.max().item()), 0) if n.numel() else 0      # all-invisible rows have rank -1
    steps = torch.arange(1, m + 1, dtype=torch.float64, device=n.device)
    table = torch.cat([torch.zeros(1, dtype=torch.float64, device=n.device), torch.cumsum(1.0 / steps, 0)])
    return table[n.clamp_min(0)]


def uniform_received(key_visible: Bool[Tensor, "... key"], causal: bool = False,
                     kind: Kind = "mass", block_length: int | None = None) -> Float[Tensor, "... key"]:
    """Closed-form received attention of *uniform* attention, query set = all visible rows.

    With n = |V| visible keys and ρ_j the rank of j among them (0-based): bidirectional m_j = 1/n;
    causal m_j = (H_n − H_{ρ_j})/n, r_j = (H_n − H_{ρ_j})/(n − ρ_j), α_j = H_n − H_{ρ_j}.
    In particular causal m_0 = H_n/n (the causal-mask share of column 0, §1.a).  Invisible keys: 0.
    ``block_length`` B (block-causal): each visible query i spreads 1/|V_i| over the visible keys of its own and
    earlier blocks; m_j = (1/n) Σ_{i: j ∈ V_i} 1/|V_i| (computed, not closed form).
    """
    if not isinstance(key_visible, Tensor):
        raise C.ArgumentTypeError(f"key_visible={validate.describe(key_visible)} is invalid: expected a bool tensor.",
                                  argument="key_visible", value=key_visible, allowed="a bool tensor")
    vis = C.mask(key_visible, name="key_visible", size=key_visible.shape[-1] if key_visible.ndim else 1)
    causal = validate.boolean(causal, name="causal")
    kind = validate.choice(kind, KINDS, name="kind")
    n = vis.sum(-1, keepdim=True)
    if block_length is not None:
        size = vis.shape[-1]
        return received_attention(uniform_pattern(size, causal, vis, block_length=block_length), key_visible=vis,
                                  kind=kind, causal=causal, block_length=block_length).to(torch.float64)
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
# §1.b / §3.3 absorption
# ----------------------------------------------------------------------------------------------

def _mass(received: Tensor, name: str, policy: str) -> Tensor:
    """float64 copy of a received-mass tensor: finite (or non-finite entries zeroed under ``omit``), >= 0."""
    C.finite_where(received, None, name=name, policy=policy)
    r = torch.nan_to_num(received.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if bool((r < 0).any()):
        raise ArgumentError(f"{name} has negative entries (min {float(r.min()):.3g}): received attention is a "
                            "mass, expected values >= 0.", argument=name, value=received, allowed="values >= 0")
    return r


def absorption(received: Float[Tensor, "... key"], anchors: Bool[Tensor, "... key"],
               nan_policy: str = "raise") -> Float[Tensor, "..."]:
    """Absorb(S) = 100 · Σ_{j∈S} m_j / Σ_j m_j  (percent; = 100 Σ_{j∈S} m_j for full-row mass).

    NaN where Σ_j m_j = 0 (no mass at all: the share is undefined).  ``received`` must be finite and
    ≥ 0 (``nan_policy="omit"``: non-finite entries count as 0).
    """
    received = C.float_tensor(received, name="received")
    anchors = C.mask(anchors, name="anchors", size=received.shape[-1], against=received.shape)
    if anchors is None:
        raise ArgumentError("anchors=None is invalid: expected a bool key mask (the anchor set S).",
                            argument="anchors", value=None, allowed="a bool tensor")
    r = _mass(received, "received", C.nan_policy(nan_policy))
    total = r.sum(-1)
    part = torch.where(anchors, r, torch.zeros_like(r)).sum(-1)
    return torch.where(total > 0, 100.0 * part / total.clamp_min(1e-300), torch.full_like(total, torch.nan))
