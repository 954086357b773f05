"""Linear probes over layer × step on a sweep's ``features`` table, and the sweep report's section of them.

    feats, targets = sweep_features(table)            # ProbeFeatures [layer, step, item, d] + per-item targets
    grids = sweep_probe_grids(table)                  # {"correct": logistic AUC per (layer, step),
                                                      #  "step": ridge R² of the latent step per layer}
    probe_heatmap(auc, auc_sig, r2, r2_sig, steps, layers, path=...)

Two probes (:func:`mdm_lens.lens.probe_grid`, item-level split shared by every cell): (a) answer correctness
(the ``acc`` target: the gold answer is a substring of the generated answer), a logistic probe per (layer,
step), scored by AUC; (b) the latent step, one ridge probe per layer over all steps (``pool_steps``), scored by
R². The confidence intervals are percentile bootstraps over test items at the family-wise level: with N cells
in a grid, each cell's interval has level 1 - alpha/N (Bonferroni), so "some cell's CI excludes chance" is
itself a claim at level 1 - alpha (a 95% interval per cell would exclude chance somewhere in a 16-cell null
grid more often than not). A claim is made only where an interval excludes chance (AUC 0.5, R² 0) and the
cell was scored on at least ``MIN_TEST`` test items (a bootstrap over fewer items says little).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from mdm_lens import validate
from mdm_lens.errors import InputError, MDMLensError
from mdm_lens.lens.linear import COLUMNS as GRID_COLUMNS
from mdm_lens.lens.linear import ProbeFeatures, probe_grid
from mdm_lens.views.figstyle import _new, _np, _styled, layer_step_axes, save

__all__ = ["sweep_features", "sweep_probe_grids", "probe_heatmap", "probes_section", "CHANCE", "TARGETS",
           "MIN_TEST"]

TARGETS = ("correct", "step")
CHANCE = {"auc": 0.5, "r2": 0.0}
MIN_TEST = 10   # test items a cell needs before its interval supports a claim
_NEEDED = ("item_id", "step", "layer", "feature", "acc")
_MAX_ROWS = 64  # cells listed per sweep and target in the report table; beyond it, each layer's best cell


def _check_table(table: Any) -> pd.DataFrame:
    if not isinstance(table, pd.DataFrame):
        raise InputError(f"table={validate.describe(table)} is not a DataFrame (a sweep's features.parquet).",
                         argument="table", value=table, allowed="the sweep's features table")
    missing = [c for c in _NEEDED if c not in table.columns]
    if missing:
        raise InputError(f"the features table lacks column(s) {missing}; it has {list(table.columns)}.",
                         argument="table", value=list(table.columns), allowed=f"columns {list(_NEEDED)}")
    return table


def sweep_features(table: pd.DataFrame) -> tuple[ProbeFeatures, pd.DataFrame]:
    """The ``[layer, step, item, d]`` features of the items whose every (step, layer) row holds a finite vector
    (items in first-seen order), and a per-item frame (``item_id``, ``acc``, ``complete``) of all items."""
    t = _check_table(table)
    rows = t[t.step.notna() & t.layer.notna()]
    items = list(dict.fromkeys(t.item_id))
    per_item = t.groupby("item_id", sort=False)["acc"].first().reindex(items)
    targets = pd.DataFrame({"item_id": items, "acc": per_item.to_numpy(dtype=float, na_value=np.nan)})
    if not len(rows):
        targets["complete"] = False
        return None, targets  # type: ignore[return-value]
    layers = sorted(int(v) for v in rows.layer.unique())
    steps = sorted(int(v) for v in rows.step.unique())
    x = np.stack(rows.feature.to_numpy()).astype(np.float32)                       # [rows, d]
    li = np.searchsorted(layers, rows.layer.to_numpy(int))
    si = np.searchsorted(steps, rows.step.to_numpy(int))
    ii = pd.Index(items).get_indexer(rows.item_id)
    acts = np.full((len(layers), len(steps), len(items), x.shape[1]), np.nan, dtype=np.float32)
    acts[li, si, ii] = x
    complete = np.isfinite(acts).all(axis=(0, 1, 3))
    targets["complete"] = complete
    if not complete.any():  # e.g. SDAR: its KV-cache forwards (prefill, store) pool no masked position
        return None, targets  # type: ignore[return-value]
    feats = ProbeFeatures(torch.from_numpy(acts[:, :, complete]), layers, steps, meta={"hook": "hook_resid_post",
                                                                                     "pool": "mean over masked"})
    return feats, targets[complete].reset_index(drop=True).assign(all_index=np.flatnonzero(complete))


def _failed(reason: str, metric: str) -> pd.DataFrame:
    """A one-row grid for a probe that could not be fit at all (e.g. fewer than two items)."""
    return pd.DataFrame([dict(layer=pd.NA, step=pd.NA, metric=metric, value=np.nan, ci_low=np.nan, ci_high=np.nan,
                              n_train=0, n_test=0, reason=reason)], columns=GRID_COLUMNS)


def sweep_probe_grids(table: pd.DataFrame, *, alpha: float = 0.05, seed: int = 0, n_boot: int = 2000
                      ) -> dict[str, pd.DataFrame]:
    """``{"correct": logistic probe of acc per (layer, step), "step": ridge R² of the latent step per layer}``
    (probe_grid tables; ``attrs["ci"]`` the per-cell level 1 - alpha/cells, ``attrs["n_items"]``)."""
    alpha = validate.number(alpha, name="alpha", min=0.0, max=1.0, min_open=True, max_open=True)
    seed = validate.seed(seed, min=None)
    n_boot = validate.integer(n_boot, name="n_boot", min=1)
    feats, targets = sweep_features(table)
    out: dict[str, pd.DataFrame] = {}
    if feats is None:
        reason = "no item has a feature vector (causal model, or nothing was masked)"
        return {"correct": _failed(reason, "auc"), "step": _failed(reason, "r2")}
    L, S, n_items = feats.acts.shape[:3]
    scored = targets.acc.notna().to_numpy()
    jobs = {"correct": (scored, "logistic", False, L * S), "step": (np.ones(n_items, bool), "ridge", True, L)}
    for name, (keep, probe, pooled, cells) in jobs.items():
        ci = 1 - alpha / cells
        if not keep.any():  # e.g. no item with a scored answer (BD3LM's answers NaN): no probe, the section says so
            grid = _failed("no item has a scored answer to fit this probe on", "auc" if name == "correct" else "r2")
            grid.attrs.update(ci=ci, alpha=alpha, cells=cells, n_items=0)
            out[name] = grid
            continue
        sub = ProbeFeatures(feats.acts[:, :, torch.tensor(keep)], feats.layers, feats.steps, meta=feats.meta)
        target = torch.tensor(targets.acc.to_numpy()[keep] == 1.0) if name == "correct" else "step"
        try:
            grid = probe_grid(sub, target, probe=probe, pool_steps=pooled, seed=seed, n_boot=n_boot, ci=ci)
        except MDMLensError as e:
            grid = _failed(f"not fit: {e}", "auc" if name == "correct" else "r2")
        grid.attrs.update(ci=ci, alpha=alpha, cells=cells, n_items=int(keep.sum()))
        out[name] = grid
    return out


@_styled
def probe_heatmap(auc: Any, auc_sig: Any, r2: Any, r2_sig: Any, steps: Sequence[int], layers: Sequence[int], *,
                  title: str = "Linear probes over layer × step", path: str | Path | None = None) -> Figure:
    """Left: AUC of the correctness probe, layers (rows, 0 at the bottom) × steps, diverging around 0.5 (grey =
    undefined), ★ where ``auc_sig``. Right: R² of the latent step per layer (one probe over all steps), ★ where
    ``r2_sig``. Cell values are written when the grid is small."""
    a, r = _np(auc), _np(r2).reshape(-1)
    a_sig, r_sig = np.asarray(auc_sig, bool), np.asarray(r2_sig, bool).reshape(-1)
    L, S = len(layers), len(steps)
    if a.shape != (L, S) or a_sig.shape != (L, S) or r.shape != (L,) or r_sig.shape != (L,):
        raise InputError(f"auc / auc_sig must be [{L}, {S}] and r2 / r2_sig [{L}]; got {a.shape}, {a_sig.shape}, "
                         f"{r.shape}, {r_sig.shape}.", argument="auc", value=a.shape, allowed=f"[{L}, {S}]")
    fig = _new((min(12.0, max(6.0, 3.0 + 0.45 * S)), min(8.0, max(2.8, 1.6 + 0.42 * L))))
    gs = fig.add_gridspec(1, 2, width_ratios=(S, max(1.2, S * 0.15)), wspace=0.08)
    ax, side = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    div = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(a), cmap=div, vmin=0.0, vmax=1.0, aspect="auto", origin="lower",
                   extent=(-0.5, S - 0.5, -0.5, L - 0.5))
    seq = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    im2 = side.imshow(np.ma.masked_invalid(np.clip(r, 0.0, 1.0))[:, None], cmap=seq, vmin=0.0, vmax=1.0,
                      aspect="auto", origin="lower", extent=(-0.5, 0.5, -0.5, L - 0.5))
    small = L * S <= 120
    for (l, s), v in np.ndenumerate(a):
        text = ("★" if a_sig[l, s] else "") + (f"\n{v:.2f}" if small and np.isfinite(v) else "")
        if text:
            ax.text(s, l, text.strip("\n"), ha="center", va="center", fontsize=7,
                    color="white" if np.isfinite(v) and abs(v - 0.5) > 0.3 else "black")
    for l, v in enumerate(r):
        text = ("★\n" if r_sig[l] else "") + (f"{v:.2f}" if np.isfinite(v) else "n/a")
        side.text(0, l, text, ha="center", va="center", fontsize=7,
                  color="white" if np.isfinite(v) and v < 0.6 else "black")
    layer_step_axes(ax, layers, steps)
    fig.suptitle(title, x=0.02, ha="left", fontsize=10, fontweight="bold")
    ax.set_title("correctness probe per (layer, step)", loc="left", fontsize=9)
    side.set_xticks([0])
    side.set_xticklabels(["all steps"])
    side.set_yticks([])
    side.set_title("step probe", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02).set_label("correctness AUC (0.5 = chance)")
    fig.colorbar(im2, ax=side, fraction=0.5, pad=0.1).set_label("R² of the step (clipped at 0)")
    return save(fig, path)


def _grid(table: pd.DataFrame, metric: str, layers: list[int], steps: list[int] | None) -> tuple[np.ndarray, ...]:
    """(values, significant) as [layer, step] (or [layer] when ``steps`` is None)."""
    t = table[table.metric == metric]
    shape = (len(layers),) if steps is None else (len(layers), len(steps))
    val, sig = np.full(shape, np.nan), np.zeros(shape, bool)
    for _, row in t.dropna(subset=["layer"]).iterrows():
        at = layers.index(int(row.layer)) if steps is None else (layers.index(int(row.layer)),
                                                                 steps.index(int(row.step)))
        val[at] = row.value
        sig[at] = _supports(row, metric)
    return val, sig


def _supports(row: Any, metric: str) -> bool:
    return bool(row.ci_low > CHANCE[metric]) and int(row.n_test) >= MIN_TEST  # NaN compares False: no claim


def _claim(label: str, grid: pd.DataFrame, metric: str) -> str:
    """One sentence: the best cell whose (family-wise) CI excludes chance, or that none does / why none could."""
    t = grid[grid.metric == metric]
    what = "answer correctness" if metric == "auc" else "the latent step"
    if not t.value.notna().any():
        reasons = t.reason.replace("", np.nan).dropna()
        why = reasons.mode().iloc[0] if len(reasons) else "undefined"
        return f"{label}: no claim on {what}, the {metric.upper()} is undefined in every cell ({why})"
    chance = "AUC 0.5" if metric == "auc" else "R² 0"
    if int(t.n_test.max()) < MIN_TEST:
        return (f"{label}: no claim on {what}, the cells were scored on {int(t.n_test.max())} test items (a claim "
                f"needs {MIN_TEST})")
    sig = t[[_supports(row, metric) for row in t.itertuples()]]
    if not len(sig):
        return f"{label}: no cell's CI excludes chance ({chance}) for {what}"
    best = sig.sort_values(["ci_low", "value"], ascending=False, kind="stable").iloc[0]
    where = f"at layer {int(best.layer)}" + (f", step {int(best.step)}" if metric == "auc" else " (all steps pooled)")
    return (f"{label}: {what} is linearly decodable above chance ({'AUC' if metric == 'auc' else 'R²'} CI above "
            f"{CHANCE[metric]:g}) {where}: {metric.upper() if metric == 'auc' else 'R²'} {best.value:.2f}, CI "
            f"[{best.ci_low:.2f}, {best.ci_high:.2f}], {int(best.n_test)} test items ({len(sig)} of {len(t)} "
            "cells exclude chance)")


def _table_rows(label: str, target: str, grid: pd.DataFrame, metric: str) -> pd.DataFrame:
    t = grid[grid.metric == metric].copy()
    if len(t) > _MAX_ROWS:  # per layer, the cell with the highest lower bound (NaN-only layers keep their first)
        order = t.assign(_k=t.ci_low.fillna(-np.inf)).sort_values(["layer", "_k"], ascending=[True, False])
        t = order.groupby("layer", sort=False).head(1).drop(columns="_k")
    step = t.step.astype("Int64").astype(object)
    step = step.where(step != -1, "all (pooled)").where(step.notna(), "")
    return pd.DataFrame({"model": label, "target": target, "layer": t.layer.astype("Int64").to_numpy(),
                         "step": step.to_numpy(), "metric": metric, "value": t.value.to_numpy(),
                         "CI low": t.ci_low.to_numpy(), "CI high": t.ci_high.to_numpy(),
                         "train items": t.n_train.to_numpy(), "test items": t.n_test.to_numpy(),
                         "reason": t.reason.to_numpy()})


def probes_section(sweeps: Sequence[Any], img: Path) -> Any:
    """The report section of the sweeps that hold a ``features`` table with finite rows (None when none does)."""
    from mdm_lens.views.report import Section

    have = [s for s in sweeps if (t := s.table("features")) is not None and t.step.notna().any()
            and sweep_features(t)[0] is not None]  # an item with a finite vector at every step and layer
    if not have:
        return None
    images, rows, finds = [], [], []
    for s in have:
        table = s.table("features")
        feats, targets = sweep_features(table)
        grids = sweep_probe_grids(table)
        layers, steps = feats.layers, feats.steps
        auc, auc_sig = _grid(grids["correct"], "auc", layers, steps)
        r2v, r2_sig = _grid(grids["step"], "r2", layers, None)
        path = img / f"probes_{s.label}.png"
        n_all = table.item_id.nunique()
        probe_heatmap(auc, auc_sig, r2v, r2_sig, steps, layers, path=path,
                      title=f"{s.label}: linear probes on the masked-mean residual ({feats.acts.shape[2]} items)")
        g, r = grids["correct"], grids["step"]
        ok = g[g.metric == "auc"]
        n_tr, n_te = (int(ok.n_train.max()), int(ok.n_test.max())) if len(ok) else (0, 0)
        n_pos = int((targets.acc == 1).sum())
        caption = (f"{s.label}: n = {g.attrs['n_items']} items with a correctness label ({n_pos} correct; "
                   f"{n_tr} train / {n_te} test, split by item) of {n_all} swept"
                   + (f" ({n_all - len(targets)} without a complete feature grid left out)" if n_all > len(targets)
                      else "") + f". ★: the CI excludes chance (on ≥ {MIN_TEST} test items); CIs are bootstrap "
                   f"intervals over test items at {g.attrs['ci']:.4f} per cell (AUC: {g.attrs['cells']} cells) and "
                   f"{r.attrs['ci']:.4f} (R²: {r.attrs['cells']} layers), i.e. {1 - g.attrs['alpha']:.0%} "
                   "family-wise (Bonferroni).")
        images.append((path, caption))
        rows += [_table_rows(s.label, "correct (acc)", g, "auc"), _table_rows(s.label, "latent step", r, "r2")]
        finds += [_claim(s.label, g, "auc"), _claim(s.label, r, "r2")]
    text = ("Linear probes on each item's `blocks.{l}.hook_resid_post`, averaged over the canvas positions still "
            "masked at that step (the sweep's `features` table). Left: a logistic probe of answer correctness "
            "(the gold answer is a substring of the generated answer) per (layer, step), scored by AUC on held-out "
            "items. Right: one ridge probe per layer over all steps predicting the step index, scored by R². "
            "Items are split once (seeded, stratified by correctness), the same split for every cell. Undefined "
            "cells (grey) give their reason in the table; no claim is made from them, nor from cells scored on fewer "
            f"than {MIN_TEST} test items.")
    return Section("Linear probes over layer × step", text, images, table=pd.concat(rows, ignore_index=True).round(3),
                   table_caption="probe metrics with family-wise CIs (n = items)",
                   finding="Measured: " + "; ".join(finds) + ".")
