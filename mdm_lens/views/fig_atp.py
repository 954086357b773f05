"""The sweep report's "Attribution patching" section (the sweep's ``atp`` table, `mdm_lens.sweep.atp_tables`).

    step_bands(table)              the table with ``band``: early / middle / late third of each item's steps
    head_grid(table, band)         [layer, head] mean over items of the per-head (``z``) AtP estimate in a band
    atp_section(sweeps, img)       the report section: heatmaps per step band, AtP vs exact scatter when present

Claims: over items only (one value per item, 95% percentile bootstrap, :mod:`mdm_lens.views.stats`): the summed
attn_out estimate (is the knockout's effect through attention outputs off 0?) and, where exact patching ran, the
per-item Pearson r of AtP against it (an estimate, not a threshold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from mdm_lens.views import stats
from mdm_lens.views.figstyle import _new, save
from mdm_lens.views.report import Section

__all__ = ["BANDS", "step_bands", "head_grid", "atp_section"]

BANDS = ("early", "middle", "late")
TITLE = "Attribution patching over denoising steps"


def step_bands(table: pd.DataFrame) -> pd.DataFrame:
    """Rows with a ``band``: the step's third of the item's own step range (an item's steps 0..n−1)."""
    t = table[table["step"].notna()].copy()
    last = t.groupby("item_id")["step"].transform("max").astype(float)
    frac = t["step"].astype(float) / last.where(last > 0, 1.0)
    t["band"] = np.asarray(BANDS, object)[np.minimum((frac * 3).astype(int).to_numpy(), 2)]
    return t


def head_grid(table: pd.DataFrame, band: str) -> pd.DataFrame:
    """[layer, head]: mean over items of each item's mean over the band's steps of the per-head estimate (NaN
    rows are skipped, never read as 0)."""
    t = step_bands(table)
    t = t[(t.component == "z") & (t.band == band)]
    per_item = t.groupby(["layer", "head", "item_id"])["value"].mean()
    return per_item.groupby(["layer", "head"]).mean().unstack("head").sort_index()


def _heatmaps(label: str, table: pd.DataFrame, path: Path) -> Path:
    grids = [head_grid(table, b) for b in BANDS]
    finite = [np.abs(v[np.isfinite(v)]) for v in (g.to_numpy(dtype=float) for g in grids)]
    top = max([float(v.max()) for v in finite if v.size] + [1e-12])  # an all-NaN grid sets no scale
    fig = _new((3.6 * len(BANDS), 3.2))
    axes = fig.subplots(1, len(BANDS))
    for ax, band, g in zip(np.atleast_1d(axes), BANDS, grids):
        im = ax.imshow(g.to_numpy(dtype=float) if g.size else np.full((1, 1), np.nan), cmap="RdBu", vmin=-top,
                       vmax=top, aspect="auto", origin="lower")
        ax.set_title(f"{label}: {band} steps")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=list(np.atleast_1d(axes)), label="mean AtP estimate, nats (< 0: knockout lowers M)")
    save(fig, path)
    return path


def _scatter(points: dict[str, pd.DataFrame], path: Path) -> Path:
    fig = _new((4.2, 4.0))
    ax = fig.subplots()
    lo, hi = 0.0, 0.0
    for label, t in points.items():
        ax.scatter(t["exact"], t["value"], s=6, alpha=0.5, label=label)
        lo, hi = min(lo, t["exact"].min(), t["value"].min()), max(hi, t["exact"].max(), t["value"].max())
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.set_xlabel("exact patching effect, nats")
    ax.set_ylabel("AtP estimate, nats")
    ax.set_title("AtP vs exact (every step, layer, head)")
    ax.legend(fontsize=7)
    save(fig, path)
    return path


def _item_pearson(t: pd.DataFrame) -> pd.Series:
    def r(g: pd.DataFrame) -> float:
        if len(g) < 2 or g["value"].std() == 0 or g["exact"].std() == 0:
            return np.nan              # undefined, excluded (counted by the interval), never 0
        return float(np.corrcoef(g["value"], g["exact"])[0, 1])
    return t.groupby("item_id")[["value", "exact"]].apply(r)


def atp_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("atp") is not None]
    if not sweeps:
        return None
    claims, images, scatter, rows = stats.Claims(), [], {}, []
    for s in sweeps:
        t = s.table("atp")
        attn = t[t.component == "attn_out"].groupby("item_id")["value"].sum()
        claims.add(f"{s.label}: Σ attn_out AtP per item", stats.bootstrap_mean(attn),
                   f"through {s.label}'s attention outputs the knockout raises M",
                   f"through {s.label}'s attention outputs the knockout lowers M",
                   f"through {s.label}'s attention outputs the knockout leaves M unchanged", digits=4, unit="nats")
        images.append((_heatmaps(s.label, t, img / f"atp_heads_{len(images)}.png"),
                       f"{s.label}: mean per-head AtP estimate by step band"))
        done = t[np.isfinite(t["exact"].astype(float))] if "exact" in t else t.iloc[:0]
        if len(done):
            scatter[s.label] = done
            claims.estimate(f"{s.label}: per-item Pearson r (AtP, exact)", stats.bootstrap_mean(_item_pearson(done)),
                            f"{s.label}'s AtP follows exact patching with a per-item Pearson r of")
        rows.append({"model": s.label, "items": t.item_id.nunique(), "cells": len(t),
                     "cells with exact": len(done), "mean |AtP|": float(t["value"].abs().mean())})
    if scatter:
        images.append((_scatter(scatter, img / "atp_vs_exact.png"), "AtP estimate vs exact patching"))
    text = ("Attribution patching (AtP) of the anchors' attention knockout: at each denoising step, (a_knockout − "
            "a_clean)·∂M/∂a on the clean step forward, per layer and head (hook_z through W_O), with M the mean "
            "log-prob of the tokens the clean run commits at that step. Heatmaps: mean over items per step band "
            "(thirds of each item's steps); the scatter compares AtP with exact patching of the same cells where "
            "the sweep ran it.")
    return Section(TITLE, text, images, table=pd.DataFrame(rows).set_index("model").round(6),
                   claims=claims.table(), finding=claims.finding())
