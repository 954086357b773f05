"""The sweep report's "KV-cache staleness" section (the sweep's ``cache`` table, `mdm_lens.sweep.cache_tables`) and
its figures.

    with_age(table)                      window-step rows with ``age``: steps since the block's refresh forward
    staleness_grid(table, metric, mode)  [layer, age] mean over items of one per-(step, layer) metric
    staleness_heatmaps(grids, ...)       modes (rows) × metrics (columns) of layer × cache-age maps
    logprob_figure(table, ...)           log-prob change (cached − fresh) by cache age, and per-layer stale patching
    cache_section(sweeps, img)           the report section; cache_skip(sweep): why a sweep is left out

Cache age: the cache's keys/values outside the window were computed at the block's refresh forward (the block's
first step); a window step's age is its step minus that one (1 = the first window forward after the refresh). The
refresh step is not a row of the table (nothing is stale there), so it is the block's smallest step minus 1 (per
item and cache mode, whatever the row order: the two modes may commit at different rates, so their steps differ).

Claims: every comparison is over items (one value per item: the mean of its finite rows), with a 95% percentile
bootstrap interval (:mod:`mdm_lens.views.stats`); a sentence says more/less only when the interval excludes 0, else
tie. The per-layer patching claims use a family-wise level (Bonferroni over the layers: 1 − 0.05 / layers). NaN
values are never averaged as 0: they are counted, with their reason, in the section's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib
import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from mdm_lens import validate
from mdm_lens.errors import ArgumentError
from mdm_lens.views import stats
from mdm_lens.views.figstyle import MDM_COLORS, _new, _styled, _tick_step, save

__all__ = ["MAP_METRICS", "with_age", "staleness_grid", "staleness_heatmaps", "logprob_figure", "cache_section",
           "cache_skip", "nan_reasons"]

TITLE = "KV-cache staleness"
MODES = ("prefix", "dual")
# metric: (label, colour scale (low, high) or None for the data's range, colormap)
MAP_METRICS: dict[str, tuple[str, tuple[float, float] | None, str]] = {
    "k_drift": ("K drift ‖stale−fresh‖/‖fresh‖", None, "magma"),
    "v_drift": ("V drift ‖stale−fresh‖/‖fresh‖", None, "magma"),
    "k_cosine": ("K cosine(stale, fresh)", None, "viridis"),
    "v_cosine": ("V cosine(stale, fresh)", None, "viridis"),
    "received_tv": ("received-attention TV", None, "magma"),
    "anchor_jaccard": ("anchor-set Jaccard", (0.0, 1.0), "viridis"),
}


def _need(table: Any, columns: Sequence[str]) -> pd.DataFrame:
    if not isinstance(table, pd.DataFrame):
        raise ArgumentError(f"table must be a pandas DataFrame (a sweep's cache table), got {type(table).__name__}.",
                            argument="table", value=type(table).__name__, allowed="pandas.DataFrame")
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ArgumentError(f"table lacks the column(s) {missing} of a cache table.", argument="table",
                            value=list(table.columns), allowed=f"columns {list(columns)}")
    return table


def _per_layer(t: pd.DataFrame) -> pd.Series:
    """Rows of one layer: ``layer`` is <NA> on whole-model rows (tables written before that used -1)."""
    return (t["layer"].astype("Int64") >= 0).fillna(False).astype(bool)


def with_age(table: pd.DataFrame) -> pd.DataFrame:
    """The rows with a step, plus ``age`` = step − the block's refresh step, which is the smallest step of the
    (item, cache mode, block) rows minus 1 (the refresh forward itself has no row), whatever the rows' order."""
    t = _need(table, ("item_id", "kv_cache", "step", "block", "layer", "metric", "value"))
    t = t[t["step"].notna()].copy()
    first = t.groupby(["item_id", "kv_cache", "block"])["step"].transform("min")
    t["age"] = (t["step"] - first + 1).astype("Int64")
    return t


def staleness_grid(table: pd.DataFrame, metric: str, mode: str) -> pd.DataFrame:
    """`[layer, age]`: the mean over items of one metric (each item's mean over its steps of that age first; NaN
    values skipped, a cell with none is NaN)."""
    t = with_age(table)
    validate.choice(mode, MODES, name="mode")
    known = sorted(set(MAP_METRICS) | set(t["metric"].dropna().astype(str)))
    validate.choice(metric, known, name="metric")  # an unknown one would give an empty grid, not an error
    t = t[(t.metric == metric) & (t.kv_cache == mode) & _per_layer(t)]
    per_item = t.groupby(["layer", "age", "item_id"])["value"].mean()
    return per_item.groupby(["layer", "age"]).mean().unstack("age").sort_index()


@_styled
def staleness_heatmaps(grids: dict[str, dict[str, pd.DataFrame]], *, title: str = TITLE,
                       path: str | Path | None = None) -> Figure:
    """One row per cache mode, one column per metric (``MAP_METRICS``): layer (0 at the bottom) × cache age maps;
    every mode shares a metric's colour scale; NaN cells are grey."""
    modes = [m for m in grids if grids[m]]
    metrics = [k for k in MAP_METRICS if any(k in grids[m] for m in modes)]
    if not modes or not metrics:
        raise ArgumentError("grids holds no [layer, age] grid.", argument="grids", value=list(grids),
                            allowed="{mode: {metric: DataFrame}}")
    fig = _new((2.3 * len(metrics) + 0.6, 2.3 * len(modes) + 0.6))
    axes = fig.subplots(len(modes), len(metrics), squeeze=False)
    for j, metric in enumerate(metrics):
        label, scale, cmap = MAP_METRICS[metric]
        vals = np.concatenate([grids[m][metric].to_numpy(float).ravel() for m in modes if metric in grids[m]])
        finite = vals[np.isfinite(vals)]
        lo, hi = scale if scale else ((float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0))
        hi = hi if hi > lo else lo + 1e-9
        cm = matplotlib.colormaps[cmap].with_extremes(bad="0.85")
        for i, mode in enumerate(modes):
            ax = axes[i, j]
            g = grids[mode].get(metric)
            if g is None or g.empty:
                ax.set_axis_off()
                ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
                continue
            a = g.to_numpy(float)
            im = ax.imshow(np.ma.masked_invalid(a), cmap=cm, vmin=lo, vmax=hi, aspect="auto", origin="lower")
            ages, layers = [int(c) for c in g.columns], [int(r) for r in g.index]
            ax.set_xticks(range(0, len(ages), _tick_step(len(ages), 8)))
            ax.set_xticklabels([str(ages[k]) for k in range(0, len(ages), _tick_step(len(ages), 8))])
            ax.set_yticks(range(0, len(layers), _tick_step(len(layers), 12)))
            ax.set_yticklabels([str(layers[k]) for k in range(0, len(layers), _tick_step(len(layers), 12))])
            if i == len(modes) - 1:
                ax.set_xlabel("cache age (steps since refresh)")
            if j == 0:
                ax.set_ylabel(f"{mode} cache\nlayer")
            if i == 0:
                ax.set_title(label, loc="left", fontsize=8)
        fig.colorbar(im, ax=list(axes[:, j]), fraction=0.05, pad=0.02, location="bottom")
    fig.suptitle(title, x=0.01, ha="left", fontweight="bold")
    return save(fig, path)


def _age_curve(t: pd.DataFrame, mode: str) -> pd.DataFrame:
    """Mean logprob_delta over items per cache age, with the bootstrap interval over items."""
    rows = []
    d = t[(t.metric == "logprob_delta") & (t.kv_cache == mode)]
    for age, g in d.groupby("age"):
        iv = stats.bootstrap_mean(stats.per_item(g))
        rows.append({"age": int(age), "mean": iv.estimate, "low": iv.low, "high": iv.high, "n": iv.n})
    return pd.DataFrame(rows, columns=["age", "mean", "low", "high", "n"])


def _patch_by_layer(table: pd.DataFrame, mode: str, level: float) -> dict[int, stats.Interval]:
    p = table[(table.metric == "patch_logprob") & (table.kv_cache == mode) & table.layer.notna()]
    return {int(l): stats.bootstrap_mean(stats.per_item(g), level=level) for l, g in p.groupby("layer")}


@_styled
def logprob_figure(table: pd.DataFrame, *, title: str = "Log-prob change under the stale cache",
                   path: str | Path | None = None) -> Figure:
    """Left: cached − fresh mean log-prob of the run's final tokens at the window's masked positions, by cache age
    (mean over items, 95% bootstrap band). Right (when the table has ``patch_logprob`` rows): the same change when
    only one layer's cached positions are stale (per layer, family-wise interval)."""
    t = with_age(table)
    modes = [m for m in MODES if (t.kv_cache == m).any()] + sorted(set(t.kv_cache) - set(MODES))
    has_patch = bool((table.metric == "patch_logprob").any())
    fig = _new((9.5 if has_patch else 5.2, 3.3))
    axes = fig.subplots(1, 2 if has_patch else 1, squeeze=False)[0]
    ax = axes[0]
    for k, mode in enumerate(modes):
        c = _age_curve(t, mode)
        if c.empty:
            continue
        col = MDM_COLORS[k % len(MDM_COLORS)]
        ax.plot(c.age, c["mean"], marker="o", color=col, label=f"{mode} cache")
        ax.fill_between(c.age, c.low, c.high, color=col, alpha=0.2, linewidth=0)
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("cache age (steps since refresh)")
    ax.set_ylabel("log-prob cached − fresh (nats)")
    ax.legend()
    ax.set_title(title, loc="left")
    if has_patch:
        ax = axes[1]
        level = _patch_level(table)
        patched = {m: _patch_by_layer(table, m, level) for m in modes}
        patched = {m: ivs for m, ivs in patched.items() if ivs}
        width = 0.8 / len(patched)
        for k, (mode, ivs) in enumerate(patched.items()):
            xs = np.array(sorted(ivs)) + (k - (len(patched) - 1) / 2) * width
            est = np.array([ivs[l].estimate for l in sorted(ivs)])
            err = np.array([[ivs[l].estimate - ivs[l].low, ivs[l].high - ivs[l].estimate] for l in sorted(ivs)]).T
            ax.bar(xs, est, width=width, color=MDM_COLORS[modes.index(mode) % len(MDM_COLORS)], label=f"{mode} cache",
                   yerr=np.nan_to_num(err), capsize=2, error_kw={"linewidth": 0.8})
        ax.axhline(0, color="0.4", linewidth=0.8)
        layers = sorted({l for ivs in patched.values() for l in ivs})
        ax.set_xticks(layers[::_tick_step(len(layers), 16)])
        ax.set_xlabel("layer whose cached positions alone are stale")
        ax.set_ylabel("log-prob patched − fresh (nats)")
        ax.set_title(f"Stale patching per layer ({100 * level:.1f}% CI)", loc="left")
        ax.legend()
    return save(fig, path)


def nan_reasons(table: pd.DataFrame) -> pd.DataFrame:
    """The undefined values: one row per (kv_cache, metric, reason) with the rows and items it covers."""
    t = _need(table, ("item_id", "kv_cache", "metric", "value", "reason"))
    bad = t[t["value"].isna()]
    out = bad.groupby(["kv_cache", "metric", bad["reason"].fillna("").astype(str)], sort=True).agg(
        rows=("value", "size"), items=("item_id", "nunique")).reset_index()
    return out


def cache_skip(sweep: Any) -> str | None:
    """Why a sweep with a cache table is left out: every value NaN (e.g. an ARM model), with the reasons."""
    t = sweep.table("cache")
    if t is None or t["value"].notna().any():
        return None
    reasons = sorted(set(t["reason"].fillna("").astype(str)) - {""})
    return "every cache value is NaN (" + ("; ".join(reasons) or "no reason recorded") + ")"


def _mode_claims(claims: stats.Claims, label: str, t: pd.DataFrame, mode: str) -> None:
    rows = t[t.kv_cache == mode]
    if not (rows.metric == "logprob_delta").any():  # e.g. every item refused with this mode: its NaN rows say why
        return
    lp = stats.bootstrap_mean(stats.per_item(rows[rows.metric == "logprob_delta"]))
    claims.add(f"{label} {mode}: log-prob cached − fresh", lp,
               f"{label}, {mode} cache: the run's final tokens are more likely under the stale cache than fresh",
               f"{label}, {mode} cache: the run's final tokens are less likely under the stale cache than fresh",
               f"{label}, {mode} cache: no measured log-prob difference between stale and fresh keys", digits=3,
               unit="nats")
    ch = stats.bootstrap_mean(stats.per_item(rows[rows.metric == "answer_changed"]))
    if (rows.metric == "answer_changed").any():
        claims.add(f"{label} {mode}: share of generated tokens changed", ch,
                   f"{label}, {mode} cache: the decoded tokens differ from the uncached decode",
                   f"{label}, {mode} cache: (a share cannot be negative)",
                   f"{label}, {mode} cache: the share of changed tokens is not distinguishable from 0", digits=3)
    for metric, what in (("k_drift", "mean K drift"), ("received_tv", "mean received-attention TV"),
                         ("anchor_jaccard", "mean anchor Jaccard")):
        of = rows[rows.metric == metric]
        if of.empty:
            continue
        iv = stats.bootstrap_mean(stats.per_item(of[_per_layer(of)]))
        claims.estimate(f"{label} {mode}: {what}", iv, f"{label}, {mode} cache: {what}", digits=3)


def _dual_vs_prefix(claims: stats.Claims, label: str, t: pd.DataFrame) -> None:
    for metric, what in (("k_drift", "K drift"), ("received_tv", "received-attention TV"),
                         ("logprob_delta", "log-prob change"), ("answer_changed", "share of changed tokens")):
        rows = t[t.metric == metric]
        if metric not in ("logprob_delta", "answer_changed"):
            rows = rows[_per_layer(rows)]
        a = stats.per_item(rows[rows.kv_cache == "dual"])
        b = stats.per_item(rows[rows.kv_cache == "prefix"])
        if not (a.notna().any() and b.notna().any()):  # a mode refused for every item: its NaN rows say why
            continue
        claims.add(f"{label}: dual − prefix {what}", stats.difference(a, b),
                   f"{label}: the dual cache's {what} is larger than the prefix cache's",
                   f"{label}: the dual cache's {what} is smaller than the prefix cache's",
                   f"{label}: dual and prefix caches alike in {what}", digits=3)


def _patch_level(t: pd.DataFrame) -> float:
    """Bonferroni over the layers with patching rows: 1 − 0.05 / layers."""
    return 1 - 0.05 / max(int(t.loc[t.metric == "patch_logprob", "layer"].nunique()), 1)


def _patch_claims(claims: stats.Claims, label: str, t: pd.DataFrame, mode: str) -> None:
    p = t[(t.metric == "patch_logprob") & (t.kv_cache == mode)]
    if p.empty:
        return
    level = _patch_level(t)
    for layer, iv in _patch_by_layer(t, mode, level).items():
        claims.add(f"{label} {mode}: layer {layer} alone stale, log-prob − fresh", iv,
                   f"{label}, {mode} cache: staleness at layer {layer} alone raises the log-prob",
                   f"{label}, {mode} cache: staleness at layer {layer} alone lowers the log-prob",
                   f"{label}, {mode} cache: staleness at layer {layer} alone has no measured effect", digits=3,
                   unit="nats")


def cache_section(sweeps: Sequence[Any], img: Path) -> Any:
    """The report section of the sweeps with a ``cache`` table (None when none has a finite value)."""
    from mdm_lens.views.report import Section

    have = [s for s in sweeps if s.table("cache") is not None and s.table("cache")["value"].notna().any()]
    if not have:
        return None
    images, summary, undefined, patch_levels = [], [], [], []
    claims = stats.Claims()
    for s in have:
        t = s.table("cache")
        modes = [m for m in MODES if (t.kv_cache == m).any()]
        grids = {m: {k: staleness_grid(t, k, m) for k in MAP_METRICS} for m in modes}
        grids = {m: {k: g for k, g in gs.items() if not g.empty} for m, gs in grids.items()}
        n_items = t.item_id.nunique()
        if any(grids.values()):
            path = img / f"cache_maps_{s.label}.png"
            staleness_heatmaps(grids, path=path, title=f"{s.label}: stale vs fresh keys/values by layer and cache "
                                                       f"age (mean over {n_items} items)")
            images.append((path, "Each cell: mean over items of the window steps of that cache age."))
        if (t.metric == "logprob_delta").any():
            path = img / f"cache_logprob_{s.label}.png"
            logprob_figure(t, path=path, title=f"{s.label}: log-prob change under the stale cache")
            images.append(path)
        for mode in modes:
            _mode_claims(claims, s.label, t, mode)
            _patch_claims(claims, s.label, t, mode)
            rows = t[t.kv_cache == mode]
            for metric, g in rows.groupby("metric", sort=False):
                per = stats.per_item(g)
                summary.append({"model": s.label, "kv_cache": mode, "metric": metric,
                                "mean over items": float(per.mean()) if per.notna().any() else float("nan"),
                                "items": int(per.notna().sum()), "NaN rows": int(g["value"].isna().sum())})
        if set(MODES) <= set(modes):
            _dual_vs_prefix(claims, s.label, t)
        for r in nan_reasons(t).itertuples(index=False):
            undefined.append(f"- {s.label}, {r.kv_cache}, {r.metric}: {r.rows} NaN row(s) in {r.items} item(s) — "
                             f"{r.reason or 'no reason recorded'}")
        if (t.metric == "patch_logprob").any():
            patch_levels.append(f"{s.label}: {100 * _patch_level(t):.4g}%")
        else:
            undefined.append(f"- {s.label}: no per-layer stale patching (`patch_logprob`) rows: the sweep's cache "
                             "probe runs `cache_effect(..., patch=False)`; run `probes.cache_effect(model, out)` "
                             "for them")
    text = ("Each item is decoded again with Fast-dLLM's approximate KV caches (`kv_cache=\"prefix\"` and "
            "`\"dual\"`, the sweep's sampler settings and seed), and every window step's cached forward is compared "
            "with a fresh uncached forward on the same canvas (`probes.cache_effect`). Maps: per layer and cache "
            "age (steps since the block's refresh forward), the relative drift and cosine of the cached keys and "
            "values, the total-variation distance of the received attention, and the Jaccard of the anchor sets. "
            "Curve: the mean log-prob of the run's final tokens at the window's masked positions, cached − fresh. "
            "Claims use one value per item and a 95% bootstrap interval over items (per-layer patching: "
            "Bonferroni over layers); an interval holding 0 is called a tie. A layer whose keys/values depend on the "
            "token alone (layer 0 of a pre-norm model without cross-position input) shows no drift while the cached "
            "tokens are unchanged.")
    if patch_levels:
        text += (" Per-layer patching levels (1 − 0.05 / layers; the sentences print them rounded): "
                 + ", ".join(patch_levels) + ".")
    if undefined:
        text += ("\n\nUndefined values (NaN, never averaged as 0) and what is not in the table:\n\n"
                 + "\n".join(undefined))
    return Section(TITLE, text, images, table=pd.DataFrame(summary).round(4),
                   table_caption="Per model, cache mode and metric: the mean over items of each item's mean "
                                 "(finite rows only), the items with a value and the NaN rows.",
                   claims=_one_ci_column(claims.table()), finding=claims.finding())


def _one_ci_column(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """`Claims` names the interval column by its level ("95% CI", and the per-layer family-wise one): one "CI"
    column and the exact "level" instead, so the table has no empty cells."""
    if df is None:
        return None
    cols = [c for c in df.columns if c.endswith("% CI")]
    ci = df[cols].bfill(axis=1).iloc[:, 0]
    level = df[cols].notna().idxmax(axis=1).str.replace(" CI", "", regex=False)
    out = df.drop(columns=cols)
    out.insert(2, "CI", ci)
    out.insert(3, "level", level)
    return out
