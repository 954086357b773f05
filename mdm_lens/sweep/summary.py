"""Summary tables from the merged long tables, as the paper reports them: mean ± std over items (population
std, numpy's default, as the reference's ``fill_between``) and n, per layer / head / step; accuracy with and
without context, its gain, and by gold position."""

from __future__ import annotations

import pandas as pd

__all__ = ["summarize", "mean_std"]


def mean_std(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Mean, population std and count of ``value`` over items (NaN values are not counted)."""
    g = df.groupby(by, dropna=False, sort=True)["value"]
    out = pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=0), "n": g.count()}).reset_index()
    return out


def _accuracy(df: pd.DataFrame) -> pd.DataFrame:
    base = mean_std(df, ["condition", "metric"]).assign(group="overall", gold_index=pd.NA)
    wide = base.pivot(index="metric", columns="condition", values="mean")
    gain = []
    if {"with_context", "no_context"} <= set(wide.columns):
        for metric, row in wide.iterrows():
            gain.append(dict(condition="gain", metric=metric, mean=row["with_context"] - row["no_context"],
                             std=float("nan"), n=int(base[(base.metric == metric)]["n"].min()), group="overall",
                             gold_index=pd.NA))
    ctx = df[(df.condition == "with_context") & df.gold_index.notna()]
    by_pos = mean_std(ctx, ["condition", "metric", "gold_index"]).assign(group="by_gold_position")
    out = pd.concat([base, pd.DataFrame(gain), by_pos], ignore_index=True)
    out["gold_index"] = out["gold_index"].astype("Int64")
    return out[["group", "condition", "gold_index", "metric", "mean", "std", "n"]]


def _knockout(df: pd.DataFrame) -> pd.DataFrame:
    by = ["condition", "metric"] + (["step"] if "step" in df.columns else [])
    return mean_std(df, by)


def _flow(df: pd.DataFrame) -> pd.DataFrame:
    """Regions differ between items: pool by region name, with the gold document under its own name."""
    d = df.copy()
    d["region"] = d["region"].where(d["kind"] != "gold", "gold doc")
    return mean_std(d, ["metric", "region"])


_BY = {"absorption": ["mode", "variant", "layer", "metric"], "temporal": ["layer", "step", "metric"],
       "qk": ["layer", "head", "metric"], "retrieval": ["method", "layer", "head", "metric"]}


def summarize(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    out = {}
    for name, df in tables.items():
        if not len(df):
            continue
        if name == "accuracy":
            out[name] = _accuracy(df)
        elif name == "knockout":
            out[name] = _knockout(df)
        elif name == "flow":
            out[name] = _flow(df)
        elif name in _BY:
            out[name] = mean_std(df, _BY[name])
    return out
