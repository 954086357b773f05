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
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError
from mdm_lens.views.figstyle import (
    ANCHOR_COLOR, NORM_COLOR, ANGLE_COLOR, series_styles, _np, save, _styled, _new, _tick_step,
    _set_token_xticks, _short, colormap, finite_mean, shown)


# --- §1.b absorption -------------------------------------------------------------------------------
_CURVE = "(mean[L], std[L] or None)"


def _curve(name: Any, value: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """`curves[name]` as (mean[L], std[L] or None): a bare array, a 2-d mean or a std of another length would be
    drawn wrong (or fail inside numpy), so each is refused naming the curve."""
    arg = f"curves[{name!r}]"
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InputError(f"{arg} must be {_CURVE}; got {validate.describe(value)}.", argument=arg, value=value,
                         allowed=f"a pair {_CURVE}")
    mean = _np(value[0], name=f"{arg}[0]")
    if mean.ndim != 1 or mean.size == 0:
        raise InputError(f"{arg} must be {_CURVE}; mean has shape {mean.shape}, expected one value per layer.",
                         argument=arg, value=mean.shape, allowed="a 1-d, non-empty mean")
    if value[1] is None:
        return mean, None
    std = _np(value[1], name=f"{arg}[1]")
    if std.ndim != 1 or std.size != mean.size:
        raise InputError(f"{arg} must be {_CURVE}; std has {std.size} entries (shape {std.shape}) for {mean.size} "
                         "layers.", argument=arg, value=std.shape, allowed=f"None or shape ({mean.size},)")
    return mean, std


def _nulls(nulls: Any, curves: dict[Any, tuple[np.ndarray, Any]]) -> dict[Any, np.ndarray]:
    """`nulls[name]`: a number or one value per layer of `curves[name]`; a name not in `curves` would still add the
    excess panel with nothing of its own in it."""
    if nulls is None:
        return {}
    if not isinstance(nulls, Mapping):
        raise ArgumentTypeError(f"nulls={validate.describe(nulls)}: expected a mapping {{model: null}} or None.",
                                argument="nulls", value=nulls, allowed="a dict or None")
    out = {}
    for name, value in nulls.items():
        if name not in curves:
            raise ArgumentError(f"nulls has the model {name!r}, which is not in curves ({list(curves)}).",
                                argument="nulls", value=name, allowed=f"keys of curves: {list(curves)}")
        if value is None:
            continue
        v = _np(value, name=f"nulls[{name!r}]")
        n_layers = curves[name][0].size
        if v.ndim > 1 or v.size not in (1, n_layers):
            raise InputError(f"nulls[{name!r}] has shape {v.shape}: expected a number or {n_layers} values (one per "
                             "layer of its curve).", argument=f"nulls[{name!r}]", value=v.shape,
                             allowed=f"a number or shape ({n_layers},)")
        out[name] = v.ravel()
    return out


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
    checked = {name: _curve(name, value) for name, value in curves.items()}
    nulls = _nulls(nulls, checked)
    styles = series_styles(list(curves))
    if show_excess is not None:
        validate.boolean(show_excess, name="show_excess")
        if show_excess and not nulls:  # the panel is the excess over the nulls: without them it would be empty
            raise ArgumentError("show_excess=True needs nulls: the lower panel plots each curve minus its null.",
                                argument="show_excess", value=True, allowed="False or None when nulls is empty")
    show_excess = bool(nulls) if show_excess is None else show_excess
    max_l = max(len(m) for m, _ in checked.values())
    fig = _new((max(6.0, min(11.0, 0.22 * max_l + 3.5)), 5.2 if show_excess else 3.8))
    if show_excess:
        gs = fig.add_gridspec(2, 1, height_ratios=(2.4, 1))
        ax = fig.add_subplot(gs[0])
        ax2 = fig.add_subplot(gs[1], sharex=ax)
    else:
        ax, ax2 = fig.add_subplot(), None
    lo_all = 0.0
    for name, (m, std) in checked.items():
        st = styles[name]
        s = np.zeros_like(m) if std is None else std
        x = np.arange(len(m))
        label = f"{name} (layer mean {shown(finite_mean(m), '.1f')})"
        ax.plot(x, m, color=st["color"], linestyle=st["linestyle"], marker=st["marker"], markersize=3.2,
                markerfacecolor=st["markerfacecolor"], label=label, zorder=3)
        if std is not None:
            ax.fill_between(x, m - s, m + s, color=st["color"], alpha=0.16, linewidth=0, zorder=1)
        low = (m - s)[np.isfinite(m - s)]  # an all-NaN curve (no layer defined) sets no bound, and warns nothing
        lo_all = min(lo_all, float(low.min())) if low.size else lo_all
        if name in nulls and nulls[name] is not None:
            nv = nulls[name]
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
    if any(sd is not None for _, sd in checked.values()):
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
def _committed(committed_step: Any, S: int, T: int) -> np.ndarray:
    """`committed_step[pos]`: a whole step < S (the row its marker goes in), < 0 for the prompt, NaN for never; a
    step past the last row used to drop its marker silently."""
    cs = _np(committed_step, name="committed_step")
    if cs.ndim != 1 or cs.size != T:
        raise InputError(f"committed_step has shape {cs.shape}: expected one entry per position ({T}).",
                         argument="committed_step", value=cs.shape, allowed=f"shape ({T},)")
    finite = np.isfinite(cs)
    bad = np.nonzero(finite & ((cs >= S) | (cs != np.round(cs))))[0]
    if bad.size:
        j = int(bad[0])
        raise OutOfRangeError(f"committed_step[{j}]={cs[j]:g} is invalid: expected a whole step in [0, {S - 1}] "
                              f"(the {S} rows of received), a negative value for a prompt position or NaN for never.",
                              argument=f"committed_step[{j}]", value=float(cs[j]), allowed=f"a step in [0, {S - 1}]")
    return np.where(finite, cs, -1)


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
    if r.ndim != 2 or r.size == 0:
        raise InputError(f"received must be a non-empty [step, pos] array, got shape {r.shape}.", argument="received",
                         value=r.shape, allowed="shape [step, pos]")
    S, T = r.shape
    # a scale it does not know used to draw linear under a "(loggg scale)" colour-bar label
    scale = validate.choice(scale, ("linear", "sqrt", "log"), name="scale")
    cmap_ = colormap(cmap)
    a = None if anchors is None else _np(anchors, dtype=bool)
    if a is not None and a.shape != r.shape:
        raise InputError(f"anchors has shape {a.shape}, received {r.shape}.", argument="anchors", value=a.shape,
                         allowed=f"shape {r.shape}")
    if token_labels is not None and len(token_labels) != T:
        raise InputError(f"token_labels has {len(token_labels)} entries for {T} positions.", argument="token_labels",
                         value=len(token_labels), allowed=f"{T} labels")
    if prompt_length is not None:  # 0 (no prompt) and T (all prompt) draw no divider; beyond, it fell off the plot
        prompt_length = validate.integer(prompt_length, name="prompt_length", min=0, max=T, error=OutOfRangeError)
    cs = None if committed_step is None else _committed(committed_step, S, T)
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
    cm = cmap_.with_extremes(bad="0.93")
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
    if cs is not None:
        gen = np.nonzero(cs >= 0)[0]
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
    mats = [_np(qk, name="qk"), _np(cos, name="cos"), _np(normprod, name="normprod")]
    T = mats[0].shape[-1] if mats[0].ndim else 0
    for arg, m in zip(("qk", "cos", "normprod"), mats):
        if m.shape != (T, T) or T == 0:
            raise InputError(f"qk, cos and normprod must all be [T, T] with T={T}; {arg} has shape {m.shape}.",
                             argument=arg, value=m.shape, allowed=f"shape ({T}, {T})")
    if isinstance(anchor_positions, np.ndarray):
        anchor_positions = anchor_positions.tolist()
    # a key past T used to draw its marker off the map (and index token_labels out of range)
    anchor_positions = validate.indices(anchor_positions, T, name="anchor_positions", what="key position",
                                        allow_empty=True)
    if token_labels is not None and len(token_labels) != T:
        raise InputError(f"token_labels has {len(token_labels)} entries for {T} positions.", argument="token_labels",
                         value=len(token_labels), allowed=f"{T} labels")
    causal = validate.boolean(causal, name="causal")
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
    n, g = _np(norm_term, name="norm_term"), _np(angle_term, name="angle_term")
    for arg, v in (("norm_term", n), ("angle_term", g)):  # a [layer, head] grid was flattened into one bar row
        if v.ndim != 1 or v.size == 0:
            raise InputError(f"{arg} has shape {v.shape}: expected one value per head (1-d, non-empty).",
                             argument=arg, value=v.shape, allowed="shape (heads,)")
    if n.shape != g.shape:
        raise InputError(f"norm_term {n.shape} and angle_term {g.shape} differ.", argument="angle_term",
                         value=g.shape, allowed=f"shape {n.shape}")
    H = n.size
    labels = [f"H{h}" for h in range(H)] if labels is None else [str(x) for x in labels]
    if len(labels) != H:
        raise InputError(f"{len(labels)} labels for {H} heads.", argument="labels", value=len(labels),
                         allowed=f"{H} labels")
    nn_ = np.append(n, finite_mean(n))
    gg = np.append(g, finite_mean(g))
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
