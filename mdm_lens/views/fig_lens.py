"""Figures of the lenses over denoising steps (`mdm_lens.lens`) and the sweep report's "Lenses over denoising
steps" section (the sweep's ``lens`` table).

    lens_heatmap(grid, steps, layers)             layer × step map (e.g. top-1 = final token on masked positions)
    emergence_map(first, commit, layers)          layer × answer position: the emergence step, commit marked
    lens_grid(table)                              [layer, step] mean of one metric of a sweep ``lens`` table
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError, OutOfRangeError
from mdm_lens.views.figstyle import _new, _np, _styled, _tick_step, colormap, layer_step_axes, save, shown

__all__ = ["lens_heatmap", "emergence_map", "lens_grid", "lens_section"]


def _check_grid(a: np.ndarray, rows: Sequence[int], cols: Sequence[int], what: str) -> None:
    if a.ndim != 2 or a.shape != (len(rows), len(cols)):
        raise InputError(f"{what} must be [{len(rows)}, {len(cols)}], got {a.shape}.", argument=what, value=a.shape,
                         allowed=f"shape ({len(rows)}, {len(cols)})")


@_styled
def lens_heatmap(grid: Any, steps: Sequence[int], layers: Sequence[int], *, title: str = "Lens over denoising steps",
                 value_label: str = "top-1 = final token", vmin: float = 0.0, vmax: float = 1.0,
                 path: str | Path | None = None, cmap: str = "viridis") -> Figure:
    """Layers (rows, layer 0 at the bottom) × denoising steps, one colour per cell; NaN cells are grey (undefined,
    e.g. nothing masked any more). A side strip gives each layer's mean over steps."""
    g = _np(grid, name="grid")
    _check_grid(g, layers, steps, "grid")
    L, S = g.shape
    vmin, vmax = validate.number(vmin, name="vmin"), validate.number(vmax, name="vmax")
    if vmax <= vmin:  # an empty colour range: every cell one colour, and the side strip divides by ~0
        raise ArgumentError(f"vmax={vmax:g} is invalid: expected a number > vmin={vmin:g}.", argument="vmax",
                            value=vmax, allowed=f"a number > {vmin:g}")
    cm = colormap(cmap).with_extremes(bad="0.85")
    fig = _new((min(11.0, max(6.5, 2.4 + 0.32 * S)), min(8.0, max(2.8, 1.6 + 0.38 * L))))
    gs = fig.add_gridspec(1, 2, width_ratios=(S, max(1.5, S * 0.18)), wspace=0.06)
    ax = fig.add_subplot(gs[0])
    side = fig.add_subplot(gs[1], sharey=ax)
    im = ax.imshow(np.ma.masked_invalid(g), cmap=cm, vmin=vmin, vmax=vmax, aspect="auto", origin="lower",
                   extent=(-0.5, S - 0.5, -0.5, L - 0.5))
    layer_step_axes(ax, layers, steps)
    means = np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in g])
    side.barh(np.arange(L), np.nan_to_num(means), height=0.8, color=cm(np.clip((np.nan_to_num(means) - vmin) /
                                                                            max(vmax - vmin, 1e-12), 0, 1)),
              edgecolor="0.3", linewidth=0.3)
    side.set_xlim(vmin, vmax)
    side.tick_params(labelleft=False)
    side.set_xlabel("layer mean")
    side.grid(axis="x")
    cb = fig.colorbar(im, ax=[ax, side], fraction=0.04, pad=0.02)
    cb.set_label(value_label)
    ax.set_title(title, loc="left")
    return save(fig, path)


@_styled
def emergence_map(first: Any, commit: Any, layers: Sequence[int], *, labels: Sequence[str] | None = None,
                  n_steps: int | None = None, title: str = "Answer emergence",
                  path: str | Path | None = None, cmap: str = "viridis") -> Figure:
    """Layers (rows, 0 at the bottom) × answer positions: the step from which the layer's top-1 is the final token
    (colour; blank = never) with the position's commit step written in each column's header (○ in cells where the
    layer knew it before the commit step)."""
    f = _np(first, name="first")
    c = _np(commit, name="commit").reshape(-1)
    if f.ndim != 2 or f.shape != (len(layers), c.shape[0]) or f.size == 0:
        raise InputError(f"first must be [{len(layers)}, {c.shape[0]}] (layers, commit's positions), got {f.shape}.",
                         argument="first", value=f.shape, allowed=f"shape ({len(layers)}, {c.shape[0]})")
    L, P = f.shape
    if labels is not None and len(labels) != P:
        raise InputError(f"labels has {len(labels)} entries for {P} answer positions.", argument="labels",
                         value=len(labels), allowed=f"{P} labels")
    seen = np.concatenate([f.reshape(-1), c])
    seen = seen[np.isfinite(seen)]
    if n_steps is not None:  # the colour scale's top: a step of `first` or `commit` past it would be clipped
        low = int(seen.max()) + 1 if seen.size else 1
        n_steps = validate.integer(n_steps, name="n_steps", min=max(low, 1), error=OutOfRangeError)
    cm = colormap(cmap).with_extremes(bad="white")
    top = n_steps if n_steps is not None else (int(seen.max()) + 1 if seen.size else 1)
    fig = _new((min(12.0, max(6.5, 2.6 + 0.5 * P)), min(8.0, max(2.8, 1.8 + 0.38 * L))))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(f), cmap=cm, vmin=0, vmax=max(top - 1, 1), aspect="auto", origin="lower",
                   extent=(-0.5, P - 0.5, -0.5, L - 0.5))
    for (l, p) in zip(*np.nonzero(np.isfinite(f) & (f < c[None]))):
        ax.plot(p, l, marker="o", markersize=4, markerfacecolor="none", markeredgecolor="white", markeredgewidth=1.2,
                linestyle="none")
    for (l, p) in zip(*np.nonzero(~np.isfinite(f))):
        ax.text(p, l, "–", ha="center", va="center", fontsize=7, color="0.5")
    ax.set_xticks(range(P))
    names = [f"{p}" if labels is None else f"{labels[p]}" for p in range(P)]
    ax.set_xticklabels([f"{n}\nc{int(c[p])}" if np.isfinite(c[p]) else n for p, n in enumerate(names)],
                       fontsize=7, rotation=0)
    ax.set_yticks(range(0, L, _tick_step(L, 16)))
    ax.set_yticklabels([str(layers[i]) for i in range(0, L, _tick_step(L, 16))])
    ax.set_xlabel("answer position (token; c = its commit step)   ○ top-1 before the commit step   – never")
    ax.set_ylabel("layer")
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("emergence step")
    ax.set_title(title, loc="left")
    return save(fig, path)


def lens_grid(table: pd.DataFrame, metric: str = "acc_masked") -> pd.DataFrame:
    """`[layer, step]` mean over items of one per-step metric of a sweep ``lens`` table (NaN values skipped)."""
    rows = table[(table.metric == metric) & table.step.notna()]
    return rows.groupby(["layer", "step"])["value"].mean().unstack("step").sort_index()


def lens_section(sweeps: Sequence[Any], img: Path) -> Any:
    """The report section of the sweeps that hold a ``lens`` table (None when none does)."""
    from mdm_lens.views.report import Section

    have = [s for s in sweeps if s.table("lens") is not None and s.table("lens").value.notna().any()]
    if not have:
        return None
    images, rows, finds = [], [], []
    for s in have:
        t = s.table("lens")
        grid = lens_grid(t)
        path = img / f"lens_{s.label}.png"
        lens_heatmap(grid.to_numpy(), [int(x) for x in grid.columns], [int(x) for x in grid.index], path=path,
                     title=f"{s.label}: logit-lens top-1 = final token, positions still masked "
                           f"({t.item_id.nunique()} items)", value_label="share of masked positions")
        images.append(path)
        em = t[(t.metric == "emergence_step") & t.answer.fillna(False).astype(bool)]
        lead = t[(t.metric == "lead") & t.answer.fillna(False).astype(bool)]
        last = int(em.layer.max()) if len(em) else None
        for layer, g in em.groupby("layer"):
            ld = lead[lead.layer == layer].value
            rows.append({"model": s.label, "layer": int(layer), "answer tokens": len(g),
                         "emerged by commit": float(g.value.notna().mean()),
                         "mean lead (steps)": float(ld.mean()) if ld.notna().any() else float("nan"),
                         "known ≥1 step early": float((ld >= 1).sum() / len(g)) if len(g) else float("nan")})
        if last is not None:
            final = [r for r in rows if r["model"] == s.label and r["layer"] == last][0]
            # no answer token emerged at that layer: the lead is undefined (NaN in the table), said in words here
            early = shown(final["known ≥1 step early"], ".0%", "an undefined share")
            lead_text = shown(final["mean lead (steps)"], ".2f", "")
            lead_text = f"{lead_text} steps" if lead_text else "undefined (no token emerged)"
            finds.append(f"{s.label}: at the last layer {early} of answer tokens are the top-1 at least one step "
                         f"before they are decoded (mean lead {lead_text})")
    text = ("The logit lens (final norm + unembedding, Dream's shift respected) at every layer and denoising step of "
            "each item's run. Heatmap: the share of canvas positions still masked at that step whose lens top-1 is "
            "the token the run finally output. Table: answer tokens (before the first stop token) per layer — the "
            "share whose top-1 becomes the final token and stays so up to the commit step, and the lead = commit "
            "step − emergence step (Prophet's 'known before decoded').")
    return Section("Lenses over denoising steps", text, images, table=pd.DataFrame(rows).round(3),
                   finding=("Measured: " + "; ".join(finds) + ".") if finds else "")
