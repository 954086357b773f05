"""Attention figures: absorption by layer, the temporal heatmap, QK maps and the QK norm/angle split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import matplotlib
from matplotlib import colors as mcolors
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.transforms import blended_transform_factory

from mdm_lens import validate
from mdm_lens.errors import InputError
from mdm_lens.views.figstyle import (
    ANCHOR_COLOR, NORM_COLOR, ANGLE_COLOR, series_styles, _np, save, _styled, _new, _tick_step,
    _set_token_xticks, _short, finite_mean, shown)


# --- §1.b absorption -------------------------------------------------------------------------------
@_styled
def absorption_by_layer(curves: Mapping[str, tuple[Any, Any]], nulls: Mapping[str, float | Any] | None = None,
                        title: str = "Attention absorbed by anchors, by layer", ylabel: str = "absorption (%)",
                        path: str | Path | None = None, xlabel: str = "layer",
                        show_excess: bool | None = None) -> Figure:
    """Absorption by layer: mean line ± 1 std band per model, a dashed uniform-null line per model and
    (when nulls are given) a lower panel with the excess over the null, so "how much more than chance"
    reads directly. `curves[name] = (mean[L], std[L])` (std may be None); models may differ in depth."""
    if not isinstance(curves, Mapping) or not curves:
        raise InputError(f"curves={validate.describe(curves)}: expected a non-empty mapping {{model: (mean, std)}}.",
                         argument="curves", value=curves, allowed="a non-empty dict")
    nulls = dict(nulls or {})
    styles = series_styles(list(curves))
    show_excess = bool(nulls) if show_excess is None else show_excess
    max_l = max(len(_np(m)) for m, _ in curves.values())
    fig = _new((max(6.0, min(11.0, 0.22 * max_l + 3.5)), 5.2 if show_excess else 3.8))
    if show_excess:
        gs = fig.add_gridspec(2, 1, height_ratios=(2.4, 1))
        ax = fig.add_subplot(gs[0])
        ax2 = fig.add_subplot(gs[1], sharex=ax)
    else:
        ax, ax2 = fig.add_subplot(), None
    lo_all = 0.0
    for name, (mean, std) in curves.items():
        st = styles[name]
        m = _np(mean).ravel()
        s = np.zeros_like(m) if std is None else _np(std).ravel()
        x = np.arange(len(m))
        label = f"{name} (layer mean {shown(finite_mean(m), '.1f')})"
        ax.plot(x, m, color=st["color"], linestyle=st["linestyle"], marker=st["marker"], markersize=3.2,
                markerfacecolor=st["markerfacecolor"], label=label, zorder=3)
        if std is not None:
            ax.fill_between(x, m - s, m + s, color=st["color"], alpha=0.16, linewidth=0, zorder=1)
        lo_all = min(lo_all, float(np.nanmin(m - s)))
        if name in nulls and nulls[name] is not None:
            nv = _np(nulls[name]).ravel()
            nl = np.full_like(m, float(nv[0])) if nv.size == 1 else nv
            ax.plot(np.arange(len(nl)), nl, color=st["color"], linestyle=(0, (4, 2.5)), linewidth=1.1, alpha=0.9,
                    zorder=2)
            if ax2 is not None:
                k = min(len(nl), len(m))
                ax2.plot(x[:k], m[:k] - nl[:k], color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                         markersize=2.8, markerfacecolor=st["markerfacecolor"], label=name)
    ax.set_ylim(bottom=min(0.0, lo_all))
    if "%" in ylabel and ax.get_ylim()[1] > 60:
        ax.set_ylim(top=min(100.0, max(ax.get_ylim()[1], 0)) + 2)
    ax.set_ylabel(ylabel)
    ax.set_title(title, loc="left")
    ax.grid(axis="y")
    ax.set_xlim(-0.5, max_l - 0.5)
    handles, labels = ax.get_legend_handles_labels()
    if nulls:
        handles.append(Line2D([], [], color="0.35", linestyle=(0, (4, 2.5)), linewidth=1.1))
        labels.append("uniform-attention null (dashed, per model)")
    if any(sd is not None for _, sd in curves.values()):
        handles.append(Patch(facecolor="0.6", alpha=0.3, linewidth=0))
        labels.append("± 1 std over samples")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    tick = _tick_step(max_l, 32)
    if ax2 is not None:
        ax.tick_params(labelbottom=False)
        ax2.axhline(0, color="0.3", linewidth=0.8)
        ax2.set_xlim(-0.5, max_l - 0.5)
        ax2.set_ylabel("excess over null\n(" + ("pts" if "%" in ylabel else "abs.") + ")")
        ax2.set_xlabel(xlabel)
        ax2.grid(axis="y")
        ax2.set_xticks(range(0, max_l, tick))
    else:
        ax.set_xlabel(xlabel)
    ax.set_xticks(range(0, max_l, tick))
    return save(fig, path)


# --- §1.g temporal heatmap ---------------------------------------------------------------------------
@_styled
def temporal_heatmap(received: Any, anchors: Any | None = None, token_labels: Sequence[str] | None = None,
                     title: str = "Received attention across denoising steps", path: str | Path | None = None,
                     committed_step: Any | None = None, prompt_length: int | None = None,
                     scale: str = "sqrt", cmap: str = "Blues") -> Figure:
    """Steps (rows, step 0 at the top) × key positions (columns); shade = received attention c_j(s);
    anchor cells (`anchors[step, pos]` True) hatched; `committed_step[pos]` (≥ 0 for generated positions,
    < 0 for the prompt) puts a marker in the row of the step that committed each position (the
    unmasking frontier). `scale`: 'linear', 'sqrt' (default: the tail stays visible next to a strong
    anchor) or 'log'. `prompt_length` draws a divider between prompt and canvas."""
    r = _np(received, name="received")
    if r.ndim != 2:
        raise InputError(f"received must be [step, pos], got shape {r.shape}.")
    S, T = r.shape
    a = None if anchors is None else _np(anchors, dtype=bool)
    if a is not None and a.shape != r.shape:
        raise InputError(f"anchors has shape {a.shape}, received {r.shape}.")
    width = float(np.clip(0.15 * T + 2.6, 6.0, 18.0))
    height = float(np.clip(0.16 * S + 1.8, 3.0, 10.0)) + (0.7 if token_labels is not None else 0)
    fig = _new((width, height))
    ax = fig.add_subplot()
    finite = r[np.isfinite(r)]
    vmax = float(finite.max()) if finite.size else 1.0
    vmax = vmax if vmax > 0 else 1.0
    if scale == "log":
        pos = finite[finite > 0]
        norm = mcolors.LogNorm(vmin=max(float(pos.min()) if pos.size else 1e-4, vmax * 1e-4), vmax=vmax)
    elif scale == "sqrt":
        norm = mcolors.PowerNorm(gamma=0.5, vmin=0.0, vmax=vmax)
    else:
        norm = mcolors.Normalize(vmin=0.0, vmax=vmax)
    cm = matplotlib.colormaps[cmap].with_extremes(bad="0.93")
    im = ax.imshow(np.ma.masked_invalid(r), aspect="auto", cmap=cm, norm=norm, origin="upper",
                   extent=(-0.5, T - 0.5, S - 0.5, -0.5))
    handles = []
    if a is not None and a.any():
        for s, j in zip(*np.nonzero(a)):
            v = r[s, j]
            dark = np.isfinite(v) and norm(v) > 0.55  # hatch colour contrasting with the cell shade
            ax.add_patch(Rectangle((j - 0.5, s - 0.5), 1, 1, fill=False, hatch="////",
                                   edgecolor="white" if dark else "black", linewidth=0.0))
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="anchor (floating token)"))
    if committed_step is not None:
        cs = _np(committed_step).ravel()
        if cs.size != T:
            raise InputError(f"committed_step has {cs.size} entries for {T} positions.")
        gen = np.nonzero((cs >= 0) & (cs < S))[0]
        if gen.size:
            ax.scatter(gen, cs[gen], marker="o", s=max(6.0, min(22.0, 900.0 / max(T, S))), facecolor="#E69F00",
                       edgecolor="black", linewidth=0.5, zorder=4)
            handles.append(Line2D([], [], marker="o", linestyle="none", markerfacecolor="#E69F00",
                                  markeredgecolor="black", markeredgewidth=0.5, label="committed at this step"))
    if prompt_length is not None and 0 < prompt_length < T:
        ax.axvline(prompt_length - 0.5, color="#D55E00", linewidth=1.2, linestyle="-")
        handles.append(Line2D([], [], color="#D55E00", linewidth=1.2, label="prompt | canvas"))
    ax.set_xlim(-0.5, T - 0.5)
    ax.set_ylim(S - 0.5, -0.5)
    _set_token_xticks(ax, token_labels, T)
    ys = _tick_step(S, 20)
    ax.set_yticks(range(0, S, ys))
    ax.set_xlabel("key position" + (" (token, index)" if token_labels is not None else ""))
    ax.set_ylabel("denoising step")
    ax.set_title(title, loc="left")
    cb = fig.colorbar(im, ax=ax, fraction=0.035, pad=0.01)
    cb.set_label("received attention" + ("" if scale == "linear" else f" ({scale} scale)"))
    if handles:
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=len(handles),
                  borderaxespad=0.2, fontsize=7.5)
        ax.set_title(title, loc="left", pad=18)
    return save(fig, path)


# --- §1.c QK maps ------------------------------------------------------------------------------------
@_styled
def qk_maps(qk: Any, cos: Any, normprod: Any, anchor_positions: Sequence[int] = (),
            title: str = "QK decomposition: q·k = ‖q‖‖k‖ cos θ", causal: bool = False,
            path: str | Path | None = None, token_labels: Sequence[str] | None = None) -> Figure:
    """Three [query, key] panels: raw q·k (no 1/√d), cos θ and ‖q‖‖k‖; anchor key columns marked with a
    red ▲ above each panel (the paper's "floating position") and a thin outline; the upper triangle
    (keys after the query) is greyed out when `causal`. In ‖q‖‖k‖ the column structure is purely ‖k_j‖."""
    mats = [_np(qk), _np(cos), _np(normprod)]
    T = mats[0].shape[-1]
    for m in mats:
        if m.shape != (T, T):
            raise InputError(f"qk, cos and normprod must all be [T, T] with T={T}; got {m.shape}.")
    if causal:
        upper = np.triu(np.ones((T, T), dtype=bool), k=1)
        mats = [np.where(upper, np.nan, m) for m in mats]
    size = float(np.clip(0.05 * T + 2.0, 3.0, 4.2))
    fig = _new((3 * size + 1.5, size + 0.8))
    axes = fig.subplots(1, 3)
    names = ["raw QK  (q·k)", "cos θ", "‖q‖ ‖k‖"]
    for i, (ax, m, name) in enumerate(zip(axes, mats, names)):
        finite = m[np.isfinite(m)]
        if i < 2:
            lim = float(np.abs(finite).max()) if finite.size else 1.0
            lim = lim if lim > 0 else 1.0
            if i == 1:
                lim = min(lim, 1.0)
            cm = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.88")
            norm = mcolors.TwoSlopeNorm(vmin=-lim, vcenter=0.0, vmax=lim)
        else:
            cm = matplotlib.colormaps["viridis"].with_extremes(bad="0.88")
            norm = mcolors.Normalize(vmin=float(finite.min()) if finite.size else 0,
                                     vmax=float(finite.max()) if finite.size else 1)
        im = ax.imshow(np.ma.masked_invalid(m), cmap=cm, norm=norm, aspect="equal", origin="upper")
        for j in anchor_positions:
            ax.add_patch(Rectangle((j - 0.5, -0.5), 1, T, fill=False, edgecolor=ANCHOR_COLOR, linewidth=0.8,
                                   linestyle=(0, (2, 2))))
            ax.plot([j], [1.0], marker="^", color=ANCHOR_COLOR, markersize=7, clip_on=False, zorder=5,
                    transform=blended_transform_factory(ax.transData, ax.transAxes),
                    markeredgecolor="white", markeredgewidth=0.4)
        ax.set_title(name, fontsize=9.5, pad=8)
        ax.set_xlabel("key position j")
        if i == 0:
            ax.set_ylabel("query position i")
        step = _tick_step(T, 10)
        ax.set_xticks(range(0, T, step))
        ax.set_yticks(range(0, T, step))
        for sp in ax.spines.values():
            sp.set_visible(True)
            sp.set_linewidth(0.6)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, shrink=0.9)
    sub = ""
    if len(anchor_positions):
        shown = ", ".join(str(int(j)) + (f" ({_short(token_labels[j])})" if token_labels is not None else "")
                          for j in anchor_positions)
        sub = f"   ▲ anchor key: {shown}"
    fig.suptitle(title + sub + ("   [causal: keys after the query masked]" if causal else ""), x=0.01,
                 ha="left", fontsize=10, fontweight="bold")
    return save(fig, path)


# --- §3.6 N / G bars ---------------------------------------------------------------------------------
@_styled
def qk_decomposition_bars(norm_term: Any, angle_term: Any, labels: Sequence[str] | None = None,
                          title: str = "Anchor QK advantage Δ = N (key norm) + G (angle), per head",
                          path: str | Path | None = None, ylabel: str = "logit advantage (per √d)") -> Figure:
    """Diverging stacked bars per head: N (key-norm term) and G (angle term) stack from zero on their own
    side; a black ◆ marks Δ = N + G. The last, separated group is the head mean."""
    n, g = _np(norm_term, name="norm_term").ravel(), _np(angle_term, name="angle_term").ravel()
    if n.shape != g.shape:
        raise InputError(f"norm_term {n.shape} and angle_term {g.shape} differ.")
    H = n.size
    labels = [f"H{h}" for h in range(H)] if labels is None else [str(x) for x in labels]
    if len(labels) != H:
        raise InputError(f"{len(labels)} labels for {H} heads.")
    nn_ = np.append(n, np.nanmean(n))
    gg = np.append(g, np.nanmean(g))
    x = np.append(np.arange(H, dtype=float), H + 0.8)
    fig = _new((float(np.clip(0.32 * H + 3.0, 5.0, 16.0)), 3.6))
    ax = fig.add_subplot()
    pos_b = np.zeros_like(nn_)
    neg_b = np.zeros_like(nn_)
    for vals, color, lab in ((nn_, NORM_COLOR, "N: key-norm term"), (gg, ANGLE_COLOR, "G: angle term")):
        v = np.nan_to_num(vals)
        bottom = np.where(v >= 0, pos_b, neg_b)
        bars = ax.bar(x, v, bottom=bottom, width=0.72, color=color, label=lab, edgecolor="white", linewidth=0.4)
        bars[-1].set_edgecolor("black")
        bars[-1].set_linewidth(0.8)
        pos_b = pos_b + np.where(v >= 0, v, 0)
        neg_b = neg_b + np.where(v < 0, v, 0)
    d = nn_ + gg
    ax.scatter(x, d, marker="D", s=18, color="black", zorder=4, label="Δ = N + G")
    ax.axhline(0, color="0.2", linewidth=0.8)
    ax.axvline(H + 0.05, color="0.6", linewidth=0.8, linestyle=":")
    ax.set_xticks(x)
    ax.set_xticklabels(labels + ["mean"], rotation=90 if H > 12 else 0, fontsize=7.5)
    ax.get_xticklabels()[-1].set_fontweight("bold")
    ax.set_xlim(-0.7, H + 1.5)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("head")
    ax.grid(axis="y")
    md = d[-1]
    share = nn_[-1] / md if md and np.isfinite(md) and md != 0 else float("nan")
    ax.set_title(title, loc="left")
    ax.text(1.012, 0.60, f"head mean:\nΔ = {md:.3g}" + (f"\nN/Δ = {share:.0%}" if np.isfinite(share) else ""),
            transform=ax.transAxes, ha="left", va="top", fontsize=7.5, color="0.25")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return save(fig, path)
