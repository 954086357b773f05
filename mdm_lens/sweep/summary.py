"""Summary tables from the merged long tables, as the paper reports them: mean ± std over items (population
std, numpy's default, as the reference's ``fill_between``), n (items with a finite value) and n_excluded
(items without one), per layer / head / step; accuracy with and without context, its gain, and by gold
position *within each passage count*.

What a summary never does: average position indices (``top1_key``, ``modal_anchor``, qk's ``anchor``) over
items, whose lengths differ (position 7 of a 20-token item and of a 90-token one are not the same place:
those stay per item in the long tables); count a pair of empty anchor sets as Jaccard 1 (``jaccard_defined``
excludes such pairs and ``n_empty_pairs`` counts them); weigh an item with two gold passages twice.
Every summary is cast to the dtypes of :mod:`mdm_lens.sweep.schema`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mdm_lens.sweep import schema

__all__ = ["summarize", "mean_std", "jaccard_defined", "POSITION_METRICS"]

POSITION_METRICS = {"temporal": ("top1_key", "modal_anchor"), "qk": ("anchor",)}


def mean_std(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Mean, population std, count (``n``) and excluded count (``n_excluded``: NaN or ±inf) of the finite ``value``s
    per group."""
    # the schema's `n` counts items with a *finite* value: ±inf is excluded like NaN, not averaged into an inf mean
    finite = pd.to_numeric(df["value"], errors="coerce").replace([np.inf, -np.inf], np.nan)
    g = df.assign(value=finite).groupby(by, dropna=False, sort=True)["value"]
    n = g.count()
    out = pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=0), "n": n, "n_excluded": g.size() - n}).reset_index()
    return out


def _accuracy(df: pd.DataFrame) -> pd.DataFrame:
    base = mean_std(df, ["condition", "metric"]).assign(group="overall", gold_index=pd.NA, n_passages=pd.NA)
    wide = base.pivot(index="metric", columns="condition", values="mean")
    gain = []
    if {"with_context", "no_context"} <= set(wide.columns):
        for metric, row in wide.iterrows():
            gain.append(dict(condition="gain", metric=metric, mean=row["with_context"] - row["no_context"],
                             std=float("nan"), n=int(base[(base.metric == metric)]["n"].min()), n_excluded=pd.NA,
                             group="overall", gold_index=pd.NA, n_passages=pd.NA))
    ctx = df[(df.condition == "with_context") & df.gold_index.notna()]
    # a gold index means a place only among prompts with as many passages: group by both
    by_pos = mean_std(ctx, ["condition", "metric", "n_passages", "gold_index"]).assign(group="by_gold_position")
    out = pd.concat([f for f in (base, pd.DataFrame(gain), by_pos) if len(f)], ignore_index=True)
    return out[["group", "condition", "n_passages", "gold_index", "metric", "mean", "std", "n", "n_excluded"]]


def _knockout(df: pd.DataFrame) -> pd.DataFrame:
    by = ["condition", "metric"] + (["step"] if "step" in df.columns else [])
    return mean_std(df, by)


def _flow(df: pd.DataFrame) -> pd.DataFrame:
    """Regions differ between items: pool by region name, every gold passage under ``gold doc``, averaged
    within the item first (an item with two gold passages counts once)."""
    d = df.copy()
    d["region"] = d["region"].where(d["kind"] != "gold", "gold doc")
    per_item = d.groupby(["item_id", "metric", "region"], dropna=False, sort=False)["value"].mean().reset_index()
    return mean_std(per_item, ["metric", "region"])


def jaccard_defined(df: pd.DataFrame) -> pd.DataFrame:
    """Per item and layer, from the temporal table: ``jaccard_defined`` (the mean Jaccard over the step pairs whose
    anchor sets are not both empty; NaN when all are) and ``n_empty_pairs`` (how many pairs were left out).
    The probe (`probes.drift`) already scores a pair of empty sets NaN and leaves it out of its nan-mean, so
    jaccard_defined is the probe's `mean_jaccard`; the rows exist so the report can say how many pairs each
    mean rests on. (An earlier summary "removed" empty pairs scored as 1 a second time, which pushed the value
    down, even below 0.)"""
    steps = df[df.step.notna() & (df.metric == "n_anchors")].sort_values(["item_id", "layer", "step"], kind="stable")
    keys = ["item_id", "layer"]
    empty = (steps["value"] == 0).astype(float)
    both = empty * empty.groupby([steps[k] for k in keys], sort=False).shift(1).fillna(0.0)   # pair (s-1, s) ∅, ∅
    g = both.groupby([steps[k] for k in keys], sort=False)
    per = pd.DataFrame({"n_empty": g.sum(), "pairs": g.size() - 1})
    mean = df[df.step.isna() & (df.metric == "mean_jaccard")].groupby(keys, sort=False)["value"].first()
    defined = per.pairs > per.n_empty
    jd = mean.reindex(per.index).where(defined)
    out = pd.concat([jd.rename("value").reset_index().assign(metric="jaccard_defined"),
                     per.n_empty.where(per.pairs > 0).rename("value").reset_index().assign(metric="n_empty_pairs")])
    out = out.assign(step=pd.NA)[["item_id", "layer", "step", "metric", "value"]]
    # item by item, jaccard_defined then n_empty_pairs (the order the rows are listed in)
    order = {k: i for i, k in enumerate(per.index)}
    rank = [order[k] for k in zip(out.item_id, out.layer)]
    return out.iloc[np.lexsort([out.metric.eq("n_empty_pairs").to_numpy(), rank])].reset_index(drop=True)


def _temporal(df: pd.DataFrame) -> pd.DataFrame:
    d = df[~df.metric.isin(POSITION_METRICS["temporal"])]
    extra = jaccard_defined(df)
    if len(extra):
        d = pd.concat([d, extra.astype({"layer": d["layer"].dtype, "step": "Int64"})], ignore_index=True)
    return mean_std(d, ["layer", "step", "metric"])


_BY = {"absorption": ["mode", "variant", "layer", "metric"], "qk": ["layer", "head", "metric"],
       "retrieval": ["method", "layer", "head", "metric"], "atp": ["component", "step", "layer", "head", "metric"]}
_MAKERS = {"accuracy": _accuracy, "knockout": _knockout, "flow": _flow, "temporal": _temporal}


def summarize(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``{probe: summary}`` for every non-empty long table that has one, in the schema's dtypes."""
    out = {}
    for name, df in tables.items():
        if not len(df) or (name not in _MAKERS and name not in _BY):
            continue
        if name in POSITION_METRICS and name != "temporal":
            df = df[~df.metric.isin(POSITION_METRICS[name])]
        s = _MAKERS[name](df) if name in _MAKERS else mean_std(df, _BY[name])
        out[name] = schema.conform(f"{name}_summary", s)
    return out
