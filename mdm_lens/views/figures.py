"""Static figures (matplotlib) mirroring the Attention-Floating paper's plots, plus the ablations we add.

Every function takes plain arrays (numpy, torch or lists) and labels, never probe dataclasses, builds a
`matplotlib.figure.Figure` directly (no `pyplot`: no global figure registry, no GUI backend, nothing
shown; safe in scripts, tests and notebooks, where a returned figure displays inline) and, when `path`
is given, saves it as a PNG (130 dpi, tight bounding box; parent folders are created).

Colours are colour-blind safe (Okabe & Ito) and consistent across figures: masked diffusion models
are blues (LLaDA/the first MDM = #0072B2, the next = #56B4E9, ...), autoregressive models are oranges
(Llama/the first ARM = #E69F00, the next = #D55E00, ...). A series is recognised as MDM or ARM from its
name (see `model_family`); qualifiers such as "no context" / "closed-book" keep the colour and switch
to a dashed line.

    absorption_by_layer      §1.b  absorption % by layer, ±1 std bands, uniform nulls, excess panel
    temporal_heatmap         §1.g  steps × positions received attention, anchors hatched, commit frontier
    qk_maps                  §1.c  raw QK / cos / ‖q‖‖k‖ maps with anchor columns marked (▲)
    qk_decomposition_bars    §3.6  per-head norm term N and angle term G of the anchor's QK advantage Δ
    retrieval_heatmap        §1.d  layers × heads retrieval scores, threshold outlines, per-layer means
    region_flow              §1.e  region-level flow rows (e.g. Answer row for gold at first/middle/last)
    knockout_effect          anchor vs random knockout effect per layer/condition
    accuracy_curves          accuracy vs #distractors / gold position, MDM vs ARM, with/without context
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib import colors as mcolors
from matplotlib.figure import Figure  # built directly: no pyplot, so the global backend is never touched
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.transforms import blended_transform_factory

__all__ = ["absorption_by_layer", "temporal_heatmap", "qk_maps", "qk_decomposition_bars", "retrieval_heatmap",
           "region_flow", "knockout_effect", "accuracy_curves", "model_family", "series_styles", "save",
           "MDM_COLORS", "ARM_COLORS", "OTHER_COLORS", "STYLE"]

# --- palette & style ---------------------------------------------------------------------------------
MDM_COLORS = ("#0072B2", "#56B4E9", "#332288", "#88CCEE")   # blues
ARM_COLORS = ("#E69F00", "#D55E00", "#882255", "#CC6677")   # oranges / warm
OTHER_COLORS = ("#009E73", "#CC79A7", "#999999", "#000000", "#F0E442")
ANCHOR_COLOR = "#D62728"     # the paper's red ▲ for floating positions
NORM_COLOR = "#009E73"       # QK norm term N
ANGLE_COLOR = "#CC79A7"      # QK angle term G
KNOCK_COLOR = "#CC79A7"      # anchor knockout
RANDOM_COLOR = "#9E9E9E"     # random-position control
DPI = 130

STYLE: dict[str, Any] = {
    "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold", "axes.labelsize": 9,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.fontsize": 8, "legend.frameon": False,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": False, "grid.alpha": 0.3,
    "grid.linewidth": 0.6, "lines.linewidth": 1.8, "lines.markersize": 4.5, "hatch.linewidth": 0.8,
    "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
    "image.interpolation": "nearest",
}

_MDM_KEYS = ("mdm", "llada", "dream", "diffusion", "masked", "bidir", "mmada", "sedd", "plaid")
_ARM_KEYS = ("arm", "llama", "qwen", "gpt", "causal", "autoreg", "mistral", "gemma", "phi")
_NOCTX = re.compile(r"(no[\s_-]*(context|ctx|rag|passages?)|closed[\s_-]*book|w/o|without)", re.I)
_QUALIFIER = re.compile(r"[\s(\[,;:+|/-]*\b(with|w/|\+)?\s*(context|ctx|rag|passages?|open[\s_-]*book)\b[)\]]?", re.I)


def model_family(name: str) -> str:
    """'mdm', 'arm' or 'other' from a series name ('LLaDA', 'tiny-mdm', 'Llama-3 (ARM)', 'Qwen', ...)."""
    s = name.lower()
    words = re.findall(r"[a-z0-9]+", s)
    if any(k in s for k in _MDM_KEYS if k not in ("mdm",)) or "mdm" in words or "mdms" in words:
        return "mdm"
    if any(k in s for k in _ARM_KEYS if k != "arm") or "arm" in words or "arms" in words:
        return "arm"
    return "other"


def _base_name(name: str) -> str:
    s = _NOCTX.sub("", name)
    s = _QUALIFIER.sub("", s)
    return re.sub(r"[\s()\[\],;:+|/-]+", " ", s).strip().lower()


def series_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Colour / line style / marker per series name: MDMs blue, ARMs orange, others from a third palette;
    names that differ only by a context qualifier share a colour; "no context" variants are dashed."""
    pools = {"mdm": list(MDM_COLORS), "arm": list(ARM_COLORS), "other": list(OTHER_COLORS)}
    used: dict[str, dict[str, str]] = {"mdm": {}, "arm": {}, "other": {}}
    markers = {"mdm": "o", "arm": "s", "other": "^"}
    out = {}
    for name in names:
        fam = model_family(name)
        base = _base_name(name)
        table = used[fam]
        if base not in table:
            pool = pools[fam]
            table[base] = pool[len(table) % len(pool)]
        noctx = bool(_NOCTX.search(name))
        out[name] = {"color": table[base], "linestyle": "--" if noctx else "-", "marker": markers[fam],
                     "markerfacecolor": "white" if noctx else table[base], "family": fam}
    return out


# --- helpers -----------------------------------------------------------------------------------------
def _np(x: Any, dtype=float) -> np.ndarray:
    if x is None:
        return None  # type: ignore[return-value]
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype).startswith("torch.bfloat16") or str(x.dtype) == "torch.float16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


def save(fig: Figure, path: str | Path | None, dpi: int = DPI) -> Figure:
    """Save `fig` as a PNG at `path` (if given; folders are created) and return it."""
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=dpi, bbox_inches="tight", format="png")
    return fig


def _styled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)
    return wrapper


class LensFigure(Figure):
    """A plain matplotlib Figure that also displays itself in Jupyter without pyplot (`_repr_png_`); with
    the inline backend active IPython's own Figure formatter takes precedence, so it shows once."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return buf.getvalue()


def _new(figsize: tuple[float, float], **kwargs: Any) -> Figure:
    return LensFigure(figsize=figsize, layout="constrained", **kwargs)


def _tick_step(n: int, max_labels: int) -> int:
    return max(1, math.ceil(n / max_labels))


def _set_token_xticks(ax, labels: Sequence[str] | None, n: int, max_labels: int = 80, fontsize: float = 6.5) -> None:
    step = _tick_step(n, max_labels)
    idx = list(range(0, n, step))
    ax.set_xticks(idx)
    if labels is not None:
        if len(labels) != n:
            raise ValueError(f"token_labels has {len(labels)} entries for {n} positions.")
        ax.set_xticklabels([f"{_short(labels[i])} {i}" for i in idx], rotation=90, fontsize=fontsize)
    else:
        ax.set_xticklabels([str(i) for i in idx], fontsize=fontsize + 1)


def _short(s: str, n: int = 12) -> str:
    s = str(s).replace("\n", "\\n").replace("\t", "\\t")
    s = s.replace("Ġ", "␣").replace("▁", "␣")
    s = s.replace("$", r"\$")  # never let a token turn on mathtext
    return s if len(s) <= n else s[: n - 1] + "…"


# --- §1.b absorption -------------------------------------------------------------------------------
@_styled
def absorption_by_layer(curves: Mapping[str, tuple[Any, Any]], nulls: Mapping[str, float | Any] | None = None,
                        title: str = "Attention absorbed by anchors, by layer", ylabel: str = "absorption (%)",
                        path: str | Path | None = None, xlabel: str = "layer",
                        show_excess: bool | None = None) -> Figure:
    """Absorption by layer: mean line ± 1 std band per model, a dashed uniform-null line per model and
    (when nulls are given) a lower panel with the excess over the null, so "how much more than chance"
    reads directly. `curves[name] = (mean[L], std[L])` (std may be None); models may differ in depth."""
    if not curves:
        raise ValueError("curves is empty.")
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
        label = f"{name} (layer mean {np.nanmean(m):.1f})"
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
    r = _np(received)
    if r.ndim != 2:
        raise ValueError(f"received must be [step, pos], got shape {r.shape}.")
    S, T = r.shape
    a = None if anchors is None else _np(anchors, dtype=bool)
    if a is not None and a.shape != r.shape:
        raise ValueError(f"anchors has shape {a.shape}, received {r.shape}.")
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
            raise ValueError(f"committed_step has {cs.size} entries for {T} positions.")
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
            raise ValueError(f"qk, cos and normprod must all be [T, T] with T={T}; got {m.shape}.")
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
    n, g = _np(norm_term).ravel(), _np(angle_term).ravel()
    if n.shape != g.shape:
        raise ValueError(f"norm_term {n.shape} and angle_term {g.shape} differ.")
    H = n.size
    labels = [f"H{h}" for h in range(H)] if labels is None else [str(x) for x in labels]
    if len(labels) != H:
        raise ValueError(f"{len(labels)} labels for {H} heads.")
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


# --- §1.d retrieval heads ----------------------------------------------------------------------------
@_styled
def retrieval_heatmap(scores: Any, title: str = "Retrieval score per head", threshold: float = 0.1,
                      path: str | Path | None = None, cmap: str = "viridis", outline: bool | None = None) -> Figure:
    """Layers (rows, layer 0 at the top) × heads, colour 0–1. Heads scoring above `threshold` are outlined
    (by default only when they are under half of all heads, so dense maps stay readable; force with
    `outline`). A side strip gives the per-layer mean (bar) and the fraction of heads above threshold (●)."""
    s = _np(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be [layer, head], got {s.shape}.")
    L, H = s.shape
    cell = float(np.clip(7.0 / max(L, H), 0.14, 0.42))
    fig = _new((H * cell + 3.2, L * cell + 1.3))
    gs = fig.add_gridspec(1, 2, width_ratios=(H, max(4.0, H * 0.22)), wspace=0.02)
    ax = fig.add_subplot(gs[0])
    side = fig.add_subplot(gs[1], sharey=ax)
    cm = matplotlib.colormaps[cmap].with_extremes(bad="0.9")
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
    means = np.nanmean(s, axis=1)
    frac = above.mean(axis=1)
    side.barh(np.arange(L), means, height=0.8, color=cm(np.clip(means, 0, 1)), edgecolor="0.3", linewidth=0.3)
    side.plot(frac, np.arange(L), marker="o", markersize=2.5, linestyle="none", color="#D55E00")
    side.set_xlim(0, 1)
    side.set_xticks([0, 0.5, 1])
    side.tick_params(labelleft=False)
    side.set_xlabel("layer mean\n● frac > thr")
    side.grid(axis="x")
    side.set_ylim(L - 0.5, -0.5)
    cb = fig.colorbar(im, ax=[ax, side], fraction=0.04, pad=0.02)
    cb.set_label("retrieval score")
    cb.ax.axhline(threshold, color="white", linewidth=1.2)
    n = np.isfinite(s).sum()
    stats = (f"mean {np.nanmean(s):.2f} · {above.sum() / max(n, 1):.0%} > {threshold:g} · "
             f"{(np.nan_to_num(s) > 0.5).sum() / max(n, 1):.0%} > 0.5")
    ax.set_title(f"{title}\n{stats}" + ("  (□ > thr)" if outline else ""), loc="left")
    return save(fig, path)


# --- §1.e region flow --------------------------------------------------------------------------------
@_styled
def region_flow(rows: Mapping[str, Any], region_labels: Sequence[str], gold_index: Mapping[str, int] | None = None,
                title: str = "Region-level attention flow (Answer row)", path: str | Path | None = None,
                kind: str = "heatmap", value_label: str = "flow share") -> Figure:
    """One row per condition (e.g. gold document first / middle / last), one column per region
    (BOS, Query, Doc1..DocN, Answer). `kind='heatmap'` (annotated cells, gold cell boxed) or 'bars'
    (grouped bars, gold bar hatched and edged). `gold_index[row]` = column of the gold region."""
    names = list(rows)
    M = np.stack([_np(rows[k]).ravel() for k in names])
    R = len(region_labels)
    if M.shape[1] != R:
        raise ValueError(f"rows have {M.shape[1]} regions, region_labels {R}.")
    gold_index = dict(gold_index or {})
    labels = [_short(x, 14) for x in region_labels]
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
    else:
        raise ValueError("kind must be 'heatmap' or 'bars'.")
    ax.set_title(title, loc="left")
    if handles and kind == "bars":
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.2)
    elif handles:
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.2)
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
    cats = [str(c) for c in layers_or_conditions]
    a, r = _np(anchor_effect).ravel(), _np(random_effect).ravel()
    if not (len(cats) == a.size == r.size):
        raise ValueError(f"{len(cats)} conditions, {a.size} anchor effects, {r.size} random effects.")
    K = len(cats)
    fig = _new((float(np.clip(0.42 * K + 3.2, 5.0, 16.0)), 3.6))
    ax = fig.add_subplot()
    x = np.arange(K)
    w = 0.38
    ekw = {"elinewidth": 0.9, "capsize": 2.0, "ecolor": "0.2"}
    b1 = ax.bar(x - w / 2, a, w, yerr=None if anchor_err is None else _np(anchor_err), color=KNOCK_COLOR,
                label=labels[0], error_kw=ekw)
    b2 = ax.bar(x + w / 2, r, w, yerr=None if random_err is None else _np(random_err), color=RANDOM_COLOR,
                label=labels[1], error_kw=ekw)
    if show_values:
        for bars in (b1, b2):
            ax.bar_label(bars, fmt="%.2g", fontsize=6.5, padding=2, color="0.25")
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
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return save(fig, path)


# --- accuracy curves ---------------------------------------------------------------------------------
@_styled
def accuracy_curves(x: Sequence[Any], series: Mapping[str, Any], xlabel: str = "number of distractor documents",
                    title: str = "Accuracy", ylabel: str = "accuracy", path: str | Path | None = None,
                    errors: Mapping[str, Any] | None = None, chance: float | None = None) -> Figure:
    """Accuracy curves (MDMs blue, ARMs orange; 'no context' / 'closed-book' series dashed with hollow
    markers). `errors[name]` adds a ± band (e.g. a binomial 95% CI); `chance` a dotted reference line.
    Non-numeric `x` (e.g. 'first', 'middle', 'last') is placed at equal spacing."""
    if not series:
        raise ValueError("series is empty.")
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
        y = _np(ys).ravel()
        if y.size != xs.size:
            raise ValueError(f"series {name!r} has {y.size} points for {xs.size} x values.")
        st = styles[name]
        ax.plot(xs, y, color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                markerfacecolor=st["markerfacecolor"], markeredgecolor=st["color"], label=name)
        if errors and name in errors and errors[name] is not None:
            e = _np(errors[name])
            lower, upper = (y - e, y + e) if e.ndim == 1 else (e[0], e[1])
            ax.fill_between(xs, lower, upper, color=st["color"], alpha=0.14, linewidth=0)
        lo, hi = min(lo, np.nanmin(y)), max(hi, np.nanmax(y))
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
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return save(fig, path)
