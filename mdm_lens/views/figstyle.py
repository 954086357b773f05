"""Shared look of the static figures: palette (Okabe & Ito, MDMs blue, ARMs orange), rc style, series
styles by model family, saving, and small axis helpers."""

from __future__ import annotations

import functools
import inspect
import io
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import matplotlib
from matplotlib.figure import Figure

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError

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
def _np(x: Any, dtype=float, name: str | None = None) -> np.ndarray:
    """`x` as a numpy array; None passes through for optional inputs, but not for a required one (`name`)."""
    if x is None:
        if name is not None:
            raise ArgumentTypeError(f"{name}=None: expected an array of numbers.", argument=name, value=None,
                                    allowed="a tensor, ndarray or nested list")
        return None  # type: ignore[return-value]
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype).startswith("torch.bfloat16") or str(x.dtype) == "torch.float16":
            x = x.float()
        x = x.numpy()
    try:
        return np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as err:  # a str, a ragged list, an object: name it instead of numpy's words
        arg = name or "array"
        # a probe's result object passed whole: say which of its fields is the array (RetrievalScores → .scores)
        field = next((f for f in ("scores", "values") if hasattr(getattr(x, f, None), "shape")), None)
        hint = (f"pass result.{field} ({tuple(getattr(x, field).shape)}), not the {type(x).__name__} object"
                if field else "ragged rows or non-numbers" if isinstance(x, (list, tuple)) else str(err))
        raise ArgumentTypeError(f"{arg}={type(x).__name__}: expected an array of numbers (tensor, ndarray or "
                                f"nested list of equal-length rows); {hint}.", argument=arg,
                                value=type(x).__name__, allowed="an array of numbers") from None


def figure_path(path: Any, name: str = "path") -> Path | None:
    """`path` checked before a figure is drawn: None, or a `.png` file path (the figure is always written as PNG)
    that is not a folder and whose missing folders can be created (else the OS or PIL errors would be raw)."""
    return None if path is None else validate.output_file(path, name=name, suffixes=(".png",), make_parents=True)


def colormap(cmap: Any, name: str = "cmap") -> Any:
    """A matplotlib colormap by name (a typo is an ArgumentError naming the nearest names, not a KeyError)."""
    return matplotlib.colormaps[validate.known_name(cmap, matplotlib.colormaps, name=name, what="matplotlib colormap")]


def save(fig: Figure, path: str | Path | None, dpi: int = DPI) -> Figure:
    """Save `fig` as a PNG at `path` (if given; folders are created) and return it."""
    if path is not None:
        p = figure_path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=dpi, bbox_inches="tight", format="png")
    return fig


def _styled(fn):
    """The figure style, and the output `path` checked before anything is drawn (a bad one fails fast, typed)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "path" in signature.parameters:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a wrong call: let the function itself raise Python's error
                pass
            else:
                figure_path(bound.arguments.get("path"))
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


def shown(x: Any, spec: str, undefined: str = "n/a") -> str:
    """`format(x, spec)` for a finite number, else `undefined` (a word saying why): report prose and figure labels
    never print a raw 'nan'."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        return undefined
    return format(value, spec) if math.isfinite(value) else undefined


def finite_mean(values: Any) -> float:
    """The mean of the finite entries, NaN when there is none (without numpy's all-NaN RuntimeWarning)."""
    a = np.asarray(values, dtype=float).ravel()
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def _tick_step(n: int, max_labels: int) -> int:
    return max(1, math.ceil(n / max_labels))


def layer_step_axes(ax: Any, layers: Sequence[Any], steps: Sequence[Any]) -> None:
    """Label a layer × step heatmap (`imshow` of `[layer, step]`, origin lower): thinned ticks, axis names."""
    L, S = len(layers), len(steps)
    ax.set_xticks(range(0, S, _tick_step(S, 24)))
    ax.set_xticklabels([str(steps[i]) for i in range(0, S, _tick_step(S, 24))])
    ax.set_yticks(range(0, L, _tick_step(L, 16)))
    ax.set_yticklabels([str(layers[i]) for i in range(0, L, _tick_step(L, 16))])
    ax.set_xlabel("denoising step")
    ax.set_ylabel("layer")


def _set_token_xticks(ax, labels: Sequence[str] | None, n: int, max_labels: int = 80, fontsize: float = 6.5) -> None:
    step = _tick_step(n, max_labels)
    idx = list(range(0, n, step))
    ax.set_xticks(idx)
    if labels is not None:
        if len(labels) != n:
            raise InputError(f"token_labels has {len(labels)} entries for {n} positions.", argument="token_labels",
                             value=len(labels), allowed=f"{n} labels")
        ax.set_xticklabels([f"{_short(labels[i])} {i}" for i in idx], rotation=90, fontsize=fontsize)
    else:
        ax.set_xticklabels([str(i) for i in idx], fontsize=fontsize + 1)


def _short(s: str, n: int = 12) -> str:
    s = str(s).replace("\n", "\\n").replace("\t", "\\t")
    s = s.replace("Ġ", "␣").replace("▁", "␣")
    s = s.replace("$", r"\$")  # never let a token turn on mathtext
    return s if len(s) <= n else s[: n - 1] + "…"
