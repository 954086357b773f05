"""Result figures: retrieval-head heatmaps, region flow, knockout effects and accuracy curves."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError
from mdm_lens.views.figstyle import (
    KNOCK_COLOR, RANDOM_COLOR, series_styles, _np, save, _styled, _new, _tick_step, _short, colormap, finite_mean,
    shown)


def _listlike(value: Any) -> bool:
    """A list, tuple, range, array or pandas index; not a str (its characters would become the categories)."""
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__") and hasattr(value, "__iter__")


def _per_category(name: str, value: Any, n: int) -> np.ndarray:
    """One value per bar / point: a 2-d array used to be flattened and then matched by its total size."""
    v = _np(value, name=name)
    if v.ndim != 1 or v.size != n:
        raise InputError(f"{name} has shape {v.shape}: expected {n} values (one per x value / condition).",
                         argument=name, value=v.shape, allowed=f"shape ({n},)")
    return v


def _error_bars(name: str, value: Any, n: int, pair: str = "below, above") -> np.ndarray:
    """A ± half-width per point (`[n]`) or two rows per point (`[2, n]`: the distances below and above for bars,
    the lower and upper bounds for a band); any other shape used to broadcast wrongly or fail inside matplotlib."""
    e = _np(value, name=name)
    if e.shape not in ((n,), (2, n)):
        raise InputError(f"{name} has shape {e.shape}: expected ({n},) (± per point) or (2, {n}) ({pair}).",
                         argument=name, value=e.shape, allowed=f"shape ({n},) or (2, {n})")
    bounds = e.ndim == 2 and "bounds" in pair
    if bounds and bool((e[0] > e[1]).any()):
        raise InputError(f"{name}: a lower bound lies above its upper bound ({e[0].tolist()} vs {e[1].tolist()}).",
                         argument=name, value=e.tolist(), allowed="lower <= upper at every point")
    if not bounds and bool((e < 0).any()):  # distances; matplotlib would raise its own ValueError on a bar
        raise InputError(f"{name} holds negative values {e[e < 0].tolist()}: error bars are distances from the "
                         f"value (± half-widths, or the {pair} distances), so >= 0.", argument=name,
                         value=e.tolist(), allowed="values >= 0")
    return e


# --- §1.d retrieval heads ----------------------------------------------------------------------------
@_styled
def retrieval_heatmap(scores: Any, title: str = "Retrieval score per head", threshold: float = 0.1,
                      path: str | Path | None = None, cmap: str = "viridis", outline: bool | None = None) -> Figure:
    """Layers (rows, layer 0 at the top) × heads, colour 0–1. Heads scoring above `threshold` are outlined
    (by default only when they are under half of all heads, so dense maps stay readable; force with
    `outline`). A side strip gives the per-layer mean (bar) and the fraction of heads above threshold (●)."""
    s = _np(scores, name="scores")
    if s.ndim != 2 or s.size == 0:
        raise InputError(f"scores must be a non-empty [layer, head] array, got shape {s.shape}.", argument="scores",
                         value=s.shape, allowed="shape [layer, head]")
    L, H = s.shape
    threshold = validate.number(threshold, name="threshold")
    cm = colormap(cmap).with_extremes(bad="0.9")
    if outline is not None:
        validate.boolean(outline, name="outline")
    cell = float(np.clip(7.0 / max(L, H), 0.14, 0.42))
    fig = _new((max(H * cell + 3.2, 5.0), max(L * cell + 1.3, 2.6)))   # small maps collapsed the layout
    # the side strip at ~1/4 of the map (at least 1.6 head-widths): a fixed 4 made it as wide as a 4-head map
    gs = fig.add_gridspec(1, 2, width_ratios=(H, max(1.6, H * 0.25)), wspace=0.08)
    ax = fig.add_subplot(gs[0])
    side = fig.add_subplot(gs[1], sharey=ax)
    im = ax.imshow(np.ma.masked_invalid(s), cmap=cm, vmin=0.0, vmax=1.0, aspect="auto", origin="upper",
                   extent=(-0.5, H - 0.5, L - 0.5, -0.5))
    above = np.nan_to_num(s, nan=-1) > threshold
    outline = (above.mean() <= 0.5) if outline is None else outline
    if outline:
        for l, h in zip(*np.nonzero(above)):
            ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=0.9))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(0, H, _tick_step(H, 16)))
    ax.set_yticks(range(0, L, _tick_step(L, 16)))
    for sp in ax.spines.values():
        sp.set_visible(True)
        sp.set_linewidth(0.6)
    means = np.array([finite_mean(row) for row in s])  # an all-NaN layer: NaN, without numpy's warning
    frac = above.mean(axis=1)
    side.barh(np.arange(L), means, height=0.8, color=cm(np.clip(means, 0, 1)), edgecolor="0.3", linewidth=0.3)
    side.plot(frac, np.arange(L), marker="o", markersize=2.5, linestyle="none", color="#D55E00")
    side.set_xlim(0, 1)
    side.set_xticks([0, 0.5, 1])
    side.tick_params(labelleft=False)
    side.set_xlabel("layer mean\n(● share > thr)")
    side.grid(axis="x")
    side.set_ylim(L - 0.5, -0.5)
    cb = fig.colorbar(im, ax=[ax, side], fraction=0.04, pad=0.02)
    cb.set_label("retrieval score")
    cb.ax.axhline(threshold, color="white", linewidth=1.2)
    n = np.isfinite(s).sum()
    stats = (f"mean {shown(finite_mean(s), '.2f')} · {above.sum() / max(n, 1):.0%} > {threshold:g} · "
             f"{(np.nan_to_num(s) > 0.5).sum() / max(n, 1):.0%} > 0.5")
    ax.set_title(f"{title}\n{stats}" + ("  (□ > thr)" if outline else ""), loc="left")
    return save(fig, path)


# --- §1.e region flow --------------------------------------------------------------------------------
def _mapping(value: Any, name: str) -> None:
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name}={type(value).__name__} is not a mapping {{series name: values}}.",
                                argument=name, value=type(value).__name__, allowed="a dict")


@_styled
def region_flow(rows: Mapping[str, Any], region_labels: Sequence[str], gold_index: Mapping[str, int] | None = None,
                title: str = "Region-level attention flow (Answer row)", path: str | Path | None = None,
                kind: str = "heatmap", value_label: str = "flow share") -> Figure:
    """One row per condition (e.g. gold document first / middle / last), one column per region
    (BOS, Query, Doc1..DocN, Answer). `kind='heatmap'` (annotated cells, gold cell boxed) or 'bars'
    (grouped bars, gold bar hatched and edged). `gold_index[row]` = column of the gold region."""
    _mapping(rows, "rows")
    kind = validate.choice(kind, ("heatmap", "bars"), name="kind")
    if not rows:
        raise InputError("rows is empty: expected {condition: one value per region}.", argument="rows", value={},
                         allowed="a non-empty dict")
    if not _listlike(region_labels) or len(region_labels) == 0:
        raise ArgumentTypeError(f"region_labels={validate.describe(region_labels)}: expected a non-empty list of "
                                "region names.", argument="region_labels", value=region_labels,
                                allowed="a non-empty list of str")
    names = list(rows)
    R = len(region_labels)
    for k in names:  # a [condition, region] grid in one row was flattened into R * n columns
        v = _np(rows[k], name=f"rows[{k!r}]")
        if v.ndim != 1 or v.size != R:
            raise InputError(f"rows[{k!r}] has shape {v.shape}: expected one value per region ({R}, as "
                             "region_labels).", argument=f"rows[{k!r}]", value=v.shape, allowed=f"shape ({R},)")
    M = np.stack([_np(rows[k]) for k in names])
    if gold_index is not None:
        _mapping(gold_index, "gold_index")
    gold_index = dict(gold_index or {})
    for k, g in gold_index.items():  # a row name not in rows was ignored; a column past R drew its box off the map
        if k not in rows:
            raise ArgumentError(f"gold_index has the row {k!r}, which is not in rows ({names}).",
                                argument="gold_index", value=k, allowed=f"keys of rows: {names}")
        gold_index[k] = validate.index(g, R, name=f"gold_index[{k!r}]", what="region column")
    labels = [_short(x, 20) for x in region_labels]  # 14 cut "other docs (mean)" to "other docs (m…"
    if kind == "heatmap":
        fig = _new((float(np.clip(0.62 * R + 2.8, 5.5, 16)), 0.52 * len(names) + 1.9))
        ax = fig.add_subplot()
        vmax = float(np.nanmax(M)) if np.isfinite(M).any() else 1.0
        im = ax.imshow(M, cmap="YlGnBu", vmin=0, vmax=vmax if vmax > 0 else 1, aspect="auto")
        for i in range(len(names)):
            for j in range(R):
                v = M[i, j]
                if np.isfinite(v):
                    dark = v > 0.6 * vmax
                    ax.text(j, i, f"{v:.3f}" if v < 0.995 else f"{v:.2f}", ha="center", va="center", fontsize=6.8,
                            color="white" if dark else "0.1")
            if names[i] in gold_index:
                g = gold_index[names[i]]
                ax.add_patch(Rectangle((g - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#D55E00", linewidth=2.2))
        ax.set_xticks(range(R))
        ax.set_xticklabels(labels, rotation=45 if R > 6 else 0, ha="right" if R > 6 else "center")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.set_xlabel("destination region (key side)")
        cb = fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
        cb.set_label(value_label)
        handles = [Patch(facecolor="none", edgecolor="#D55E00", linewidth=2.0, label="gold document")] \
            if gold_index else []
    elif kind == "bars":
        fig = _new((float(np.clip(0.55 * R * max(1, len(names)) / 2 + 3, 6, 16)), 3.6))
        ax = fig.add_subplot()
        w = 0.8 / len(names)
        # conditions are ordered (gold first → last): a sequential palette, not the MDM/ARM colours
        palette = [matplotlib.colormaps["viridis"](v) for v in np.linspace(0.12, 0.85, len(names))]
        for i, name in enumerate(names):
            xs = np.arange(R) - 0.4 + w * (i + 0.5)
            bars = ax.bar(xs, M[i], width=w * 0.95, color=palette[i], label=name)
            if name in gold_index:
                b = bars[gold_index[name]]
                b.set_hatch("///")
                b.set_edgecolor("black")
                b.set_linewidth(1.0)
        ax.set_xticks(range(R))
        ax.set_xticklabels(labels, rotation=45 if R > 6 else 0, ha="right" if R > 6 else "center")
        ax.set_ylabel(value_label)
        ax.set_xlabel("destination region")
        ax.grid(axis="y")
        handles = ax.get_legend_handles_labels()[0]
        if gold_index:
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="gold document"))
    else:  # unreachable: kind was checked above
        raise AssertionError(kind)
    ax.set_title(title, loc="left")
    if handles and kind == "bars":
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.2)
    elif handles:  # beside the colour bar's foot, clear of the title (above the axes it overlapped it)
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, -0.02), borderaxespad=0.2, frameon=False,
                  handlelength=1.2)
    return save(fig, path)


# --- knockouts ---------------------------------------------------------------------------------------
@_styled
def knockout_effect(layers_or_conditions: Sequence[Any], anchor_effect: Any, random_effect: Any,
                    anchor_err: Any | None = None, random_err: Any | None = None,
                    ylabel: str = "effect of knockout", title: str = "Anchor vs random-position knockout",
                    path: str | Path | None = None, labels: tuple[str, str] = ("anchor keys removed",
                                                                                 "random keys removed (control)"),
                    xlabel: str | None = None, show_values: bool = False) -> Figure:
    """Grouped bars per layer/condition: knocking out the anchor keys vs the same number of random keys,
    with optional error bars (e.g. std or 95% CI); `show_values` prints each bar's value."""
    if not _listlike(layers_or_conditions):
        raise ArgumentTypeError(f"layers_or_conditions={validate.describe(layers_or_conditions)}: expected a list of "
                                "layers or condition names.", argument="layers_or_conditions",
                                value=layers_or_conditions, allowed="a list")
    cats = [str(c) for c in layers_or_conditions]
    K = len(cats)
    if K == 0:
        raise InputError("layers_or_conditions is empty.", argument="layers_or_conditions", value=[],
                         allowed="at least one layer or condition")
    a, r = _per_category("anchor_effect", anchor_effect, K), _per_category("random_effect", random_effect, K)
    anchor_err = None if anchor_err is None else _error_bars("anchor_err", anchor_err, K)
    random_err = None if random_err is None else _error_bars("random_err", random_err, K)
    if not (isinstance(labels, (tuple, list)) and len(labels) == 2):
        raise ArgumentTypeError(f"labels={validate.describe(labels)}: expected two legend labels (anchor, random).",
                                argument="labels", value=labels, allowed="a pair of str")
    show_values = validate.boolean(show_values, name="show_values")
    fig = _new((float(np.clip(0.42 * K + 3.2, 5.6, 16.0)), 3.8))
    ax = fig.add_subplot()
    x = np.arange(K)
    w = 0.38
    ekw = {"elinewidth": 0.9, "capsize": 2.0, "ecolor": "0.2"}
    b1 = ax.bar(x - w / 2, a, w, yerr=anchor_err, color=KNOCK_COLOR, label=labels[0], error_kw=ekw)
    b2 = ax.bar(x + w / 2, r, w, yerr=random_err, color=RANDOM_COLOR,
                label=labels[1], error_kw=ekw)
    if show_values:  # two decimals, and a plain 0.00 for float noise (not "1.7e-06")
        for bars, v in ((b1, a), (b2, r)):
            ax.bar_label(bars, labels=[f"{0.0 if abs(x) < 5e-3 else x:.2f}" for x in v], fontsize=6.5, padding=2,
                         color="0.25")
    ax.axhline(0, color="0.2", linewidth=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(cats, rotation=45 if K > 10 or max(len(c) for c in cats) > 8 else 0,
                       ha="right" if K > 10 or max(len(c) for c in cats) > 8 else "center")
    ax.set_ylabel(ylabel)
    if xlabel is None:
        xlabel = "layer" if all(re.fullmatch(r"(L|layer\s*)?\d+", c, re.I) for c in cats) else "condition"
    ax.set_xlabel(xlabel)
    ax.grid(axis="y")
    ax.set_title(title, loc="left")
    # below the axes: beside them, a two-model figure spent half its width on the legend
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16 if ax.get_xlabel() else -0.08), ncol=2, frameon=False)
    return save(fig, path)


# --- accuracy curves ---------------------------------------------------------------------------------
@_styled
def accuracy_curves(x: Sequence[Any], series: Mapping[str, Any], xlabel: str = "number of distractor documents",
                    title: str = "Accuracy", ylabel: str = "accuracy", path: str | Path | None = None,
                    errors: Mapping[str, Any] | None = None, chance: float | None = None) -> Figure:
    """Accuracy curves (MDMs blue, ARMs orange; 'no context' / 'closed-book' series dashed with hollow
    markers). `errors[name]` adds a ± band (e.g. a binomial 95% CI); `chance` a dotted reference line.
    Non-numeric `x` (e.g. 'first', 'middle', 'last') is placed at equal spacing."""
    _mapping(series, "series")
    if not series:
        raise InputError("series is empty.", argument="series", value={}, allowed="a non-empty dict")
    if not _listlike(x) or len(x) == 0:
        raise ArgumentTypeError(f"x={validate.describe(x)}: expected a non-empty list of x values.", argument="x",
                                value=x, allowed="a non-empty list")
    if errors is not None:
        _mapping(errors, "errors")
        for name in errors:  # a name not in series was silently ignored
            if name not in series:
                raise ArgumentError(f"errors has the series {name!r}, which is not in series ({list(series)}).",
                                    argument="errors", value=name, allowed=f"keys of series: {list(series)}")
    if chance is not None:
        chance = validate.number(chance, name="chance")
    styles = series_styles(list(series))
    labels = [str(v) for v in x]
    try:
        xs = np.asarray([float(v) for v in x])
        numeric = True
    except (TypeError, ValueError):
        xs, numeric = np.arange(len(labels), dtype=float), False
    fig = _new((6.4, 3.8))
    ax = fig.add_subplot()
    lo, hi = np.inf, -np.inf
    for name, ys in series.items():
        y = _per_category(f"series[{name!r}]", ys, xs.size)
        st = styles[name]
        ax.plot(xs, y, color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                markerfacecolor=st["markerfacecolor"], markeredgecolor=st["color"], label=name)
        if errors and name in errors and errors[name] is not None:
            e = _error_bars(f"errors[{name!r}]", errors[name], xs.size, "lower, upper bounds")
            lower, upper = (y - e, y + e) if e.ndim == 1 else (e[0], e[1])
            ax.fill_between(xs, lower, upper, color=st["color"], alpha=0.14, linewidth=0)
        finite = y[np.isfinite(y)]
        if finite.size:
            lo, hi = min(lo, finite.min()), max(hi, finite.max())
    if chance is not None:
        ax.axhline(chance, color="0.4", linestyle=":", linewidth=1.0, label="chance")
    if lo >= 0 and hi <= 1:
        ax.set_ylim(0, 1.02)
    elif lo >= 0 and hi <= 100 and hi > 1:
        ax.set_ylim(0, 102)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels if not numeric else [f"{v:g}" for v in xs])
    if not numeric:
        ax.set_xlim(-0.35, len(xs) - 0.65)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y")
    ax.set_title(title, loc="left")
    # below the axes: beside them, a two-model figure spent half its width on the legend
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16 if ax.get_xlabel() else -0.08), ncol=2, frameon=False)
    return save(fig, path)
