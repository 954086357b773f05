"""Bootstrap intervals over items for the sweep report, and the wording of a comparison that follows from one.

The resampling unit is the item: a table's rows are first reduced to one value per ``item_id``
(:func:`per_item`), then items are drawn with replacement (percentile bootstrap, seeded, so a report is
reproducible). A comparison is *supported* only when its whole interval lies on one side of 0; an
interval that contains 0 is a tie, and one with fewer than two items (or no finite value) is undefined.

    iv = paired_difference(gain_mdm, gain_arm)          # Series indexed by item_id
    iv.verdict                                           # "positive" | "negative" | "tie" | "undefined"
    compare(iv, "the passages help A more than B", "... B more than A", "A and B gain alike")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

__all__ = ["Interval", "Claims", "per_item", "bootstrap_mean", "paired_difference", "difference", "compare",
           "fmt"]

LEVEL = 0.95
N_BOOT = 2000
SEED = 0
_CHUNK = 256            # bootstrap draws per chunk: keeps the [draws, items] index array small


@dataclass(frozen=True)
class Interval:
    """A mean (or mean difference) over items with its percentile-bootstrap interval.

    ``n``: items in the estimate (paired: items present, and finite, in both); ``n_other``: the second group's
    items of an unpaired difference (else None); ``n_excluded``: items dropped for a missing or NaN value."""

    estimate: float
    low: float
    high: float
    n: int
    n_other: int | None = None
    n_excluded: int = 0
    level: float = LEVEL

    @property
    def verdict(self) -> str:
        """``positive`` (low > 0), ``negative`` (high < 0), ``tie`` (the interval holds 0) or ``undefined``."""
        if not all(math.isfinite(v) for v in (self.estimate, self.low, self.high)):
            return "undefined"
        if self.low > 0:
            return "positive"
        if self.high < 0:
            return "negative"
        return "tie"

    @property
    def n_text(self) -> str:
        items = f"{self.n}" if self.n_other is None else f"{self.n} + {self.n_other}"
        return f"n = {items} items" + (f", {self.n_excluded} excluded (no value)" if self.n_excluded else "")

    def text(self, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
        """``+0.33 (95% CI +0.08 to +0.58; n = 12 items)``; ``scale`` multiplies every number (100 for points)."""
        u = f" {unit}" if unit else ""
        if not math.isfinite(self.estimate):
            return f"undefined ({self.n_text})"
        ci = (f"{fmt(self.low * scale, digits)} to {fmt(self.high * scale, digits)}"
              if math.isfinite(self.low) and math.isfinite(self.high) else "undefined with one item")
        return f"{fmt(self.estimate * scale, digits)}{u} ({100 * self.level:.0f}% CI {ci}; {self.n_text})"

    def row(self, scale: float = 1.0) -> dict[str, Any]:
        """The interval as table columns (same numbers the sentence quotes, before rounding)."""
        return {"Δ": self.estimate * scale, "CI low": self.low * scale, "CI high": self.high * scale,
                "n items": self.n if self.n_other is None else f"{self.n} + {self.n_other}",
                "verdict": self.verdict}


def fmt(x: float, digits: int = 2) -> str:
    """Signed fixed-point, with float noise below the last digit shown as +0.00 (never -0.00)."""
    if not math.isfinite(x):
        return "n/a"
    x = 0.0 if abs(x) < 0.5 * 10 ** -digits else x
    return f"{x:+.{digits}f}"


def per_item(df: pd.DataFrame, value: str = "value", item: str = "item_id") -> pd.Series:
    """One value per item: the mean of its finite rows (so items with more rows do not weigh more); an item
    with no finite row is NaN (counted as excluded by the interval functions)."""
    if not isinstance(df, pd.DataFrame):
        raise ArgumentTypeError(f"df must be a pandas DataFrame, got {type(df).__name__}.", argument="df",
                                value=type(df).__name__, allowed="pandas.DataFrame")
    for name, col in (("value", value), ("item", item)):
        if col not in df.columns:
            raise ArgumentError(f"{name}={col!r} is not a column of df (columns: {', '.join(map(str, df.columns))}).",
                                argument=name, value=col, allowed="a column of df")
    finite = pd.to_numeric(df[value], errors="coerce").replace([np.inf, -np.inf], np.nan)  # skip an inf row only
    return finite.groupby(df[item], sort=False).mean()


def _values(x: Any, name: str) -> tuple[np.ndarray, int]:
    try:
        a = np.asarray(x.to_numpy() if isinstance(x, pd.Series) else x, dtype=float).reshape(-1)
    except (TypeError, ValueError) as err:
        raise ArgumentTypeError(f"{name}={validate.describe(x)} is not a set of numbers ({err}).", argument=name,
                                value=x, allowed="a pandas Series or a sequence of numbers") from None
    keep = np.isfinite(a)
    return a[keep], int((~keep).sum())


def _boot_means(groups: list[np.ndarray], n_boot: int, seed: int) -> np.ndarray:
    """[n_boot] sums over groups of the resampled group means (one group: the mean; two: mean_a − mean_b
    when the second group is passed negated)."""
    rng = np.random.default_rng(seed)
    out = np.zeros(n_boot)
    for g in groups:
        for s in range(0, n_boot, _CHUNK):
            k = min(_CHUNK, n_boot - s)
            out[s:s + k] += g[rng.integers(0, len(g), size=(k, len(g)))].mean(1)
    return out


def _interval(groups: list[np.ndarray], n_boot: int, seed: int, level: float) -> tuple[float, float, float]:
    if any(len(g) == 0 for g in groups):
        return math.nan, math.nan, math.nan
    est = float(sum(g.mean() for g in groups))
    if any(len(g) < 2 for g in groups):
        return est, math.nan, math.nan
    boots = _boot_means(groups, n_boot, seed)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    # a constant sample resamples to itself: the interval is that point, whatever rounding the sum did
    return est, float(min(lo, est)), float(max(hi, est))


def _check(n_boot: int, seed: int, level: float) -> tuple[int, int, float]:
    return (validate.integer(n_boot, name="n_boot", min=100), validate.seed(seed),
            validate.number(level, name="level", min=0, max=1, min_open=True, max_open=True))


def bootstrap_mean(values: Any, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL) -> Interval:
    """Mean of one value per item (NaN items excluded and counted) with its percentile-bootstrap interval."""
    n_boot, seed, level = _check(n_boot, seed, level)
    a, bad = _values(values, "values")
    est, lo, hi = _interval([a], n_boot, seed, level)
    return Interval(est, lo, hi, len(a), None, bad, level)


def paired_difference(a: pd.Series, b: pd.Series, n_boot: int = N_BOOT, seed: int = SEED,
                      level: float = LEVEL) -> Interval:
    """Mean over items of a − b (both indexed by item id), resampling items: only items with a finite value in
    both count; the others are excluded and counted."""
    n_boot, seed, level = _check(n_boot, seed, level)
    for name, s in (("a", a), ("b", b)):
        if not isinstance(s, pd.Series):
            raise ArgumentTypeError(f"{name} must be a pandas Series indexed by item id, got {type(s).__name__}.",
                                    argument=name, value=type(s).__name__, allowed="pandas.Series")
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1)
    d = (both["a"] - both["b"]).to_numpy(dtype=float)
    keep = np.isfinite(d)
    est, lo, hi = _interval([d[keep]], n_boot, seed, level)
    return Interval(est, lo, hi, int(keep.sum()), None, int((~keep).sum()), level)


def difference(a: pd.Series, b: pd.Series, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL) -> Interval:
    """mean(a) − mean(b): paired over items when both hold the same item ids, else two independent samples
    (each resampled on its own; ``n`` and ``n_other`` give both sizes)."""
    if isinstance(a, pd.Series) and isinstance(b, pd.Series) and set(a.index) == set(b.index):
        return paired_difference(a, b, n_boot, seed, level)
    n_boot, seed, level = _check(n_boot, seed, level)
    xa, bad_a = _values(a, "a")
    xb, bad_b = _values(b, "b")
    est, lo, hi = _interval([xa, -xb], n_boot, seed, level)
    return Interval(est, lo, hi, len(xa), len(xb), bad_a + bad_b, level)


def compare(iv: Interval, positive: str, negative: str, tie: str, digits: int = 2, scale: float = 1.0,
            unit: str = "") -> str:
    """The sentence an interval allows: ``positive`` only when it lies above 0, ``negative`` only below 0,
    else ``tie`` (the interval holds 0) or 'undefined'; each followed by Δ, its interval and n."""
    body = iv.text(digits, scale, unit)
    if iv.verdict == "positive":
        return f"{positive}: Δ = {body}"
    if iv.verdict == "negative":
        return f"{negative}: Δ = {body}"
    if iv.verdict == "tie":
        return f"{tie} (tie: the interval holds 0): Δ = {body}"
    # no verdict: the tie wording is the question, not the answer (with n = 0 there is no data at all)
    why = "no item has a value" if iv.n == 0 or iv.n_other == 0 else "too few items for an interval"
    return f"undecided whether {tie}: {why} (Δ = {body})"


class Claims:
    """The comparisons of one report section: each :meth:`add` returns the sentence its interval allows and
    keeps a table row with the same numbers as printed (Δ, interval, n), so the finding and the table agree."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.sentences: list[str] = []

    def add(self, what: str, iv: Interval, positive: str, negative: str, tie: str, digits: int = 2,
            scale: float = 1.0, unit: str = "") -> str:
        sentence = compare(iv, positive, negative, tie, digits, scale, unit)
        self._row(what, iv, digits, scale, unit, iv.verdict)
        self.sentences.append(sentence)
        return sentence

    def estimate(self, what: str, iv: Interval, sentence: str, digits: int = 2, scale: float = 1.0,
                 unit: str = "") -> str:
        """A quantity, not a comparison: ``"{sentence} {value (interval; n)}"``; the row's verdict is 'estimate'."""
        out = f"{sentence} {iv.text(digits, scale, unit)}"
        self._row(what, iv, digits, scale, unit, "estimate")
        self.sentences.append(out)
        return out

    def rank(self, per_model: dict[str, pd.Series], what: str, more: str, alike: str, digits: int = 2,
             scale: float = 1.0, unit: str = "") -> None:
        """The model with the largest mean against every other one (paired over shared items, else unpaired);
        ``more`` / ``alike`` are templates with ``{a}`` and ``{b}``. With three or more models, '{a} ... every
        other model' is added only when every comparison supports it."""
        names = [m for m, v in per_model.items() if np.isfinite(np.asarray(v, dtype=float)).any()]
        if len(names) < 2:
            return
        top = max(names, key=lambda m: float(np.nanmean(np.asarray(per_model[m], dtype=float))))
        verdicts = []
        for other in (m for m in names if m != top):
            iv = difference(per_model[top], per_model[other])
            self.add(f"{what}: {top} − {other}", iv, more.format(a=top, b=other), more.format(a=other, b=top),
                     alike.format(a=top, b=other), digits, scale, unit)
            verdicts.append(iv.verdict)
        if len(names) > 2 and all(v == "positive" for v in verdicts):
            self.sentences.append(more.format(a=top, b="every other model") + " (each comparison above)")

    def _row(self, what: str, iv: Interval, digits: int, scale: float, unit: str, verdict: str) -> None:
        ci = (f"{fmt(iv.low * scale, digits)} to {fmt(iv.high * scale, digits)}"
              if math.isfinite(iv.low) and math.isfinite(iv.high) else "n/a")
        self.rows.append({"comparison": what, "Δ": fmt(iv.estimate * scale, digits) + (f" {unit}" if unit else ""),
                          f"{100 * iv.level:.0f}% CI": ci,
                          "n items": str(iv.n) if iv.n_other is None else f"{iv.n} + {iv.n_other}",
                          "excluded": iv.n_excluded, "verdict": verdict})

    def table(self) -> pd.DataFrame | None:
        return pd.DataFrame(self.rows) if self.rows else None

    def finding(self, lead: str = "Measured (mean over items, 95% bootstrap CI over items)") -> str:
        return f"{lead}: " + "; ".join(self.sentences) + "." if self.sentences else ""
