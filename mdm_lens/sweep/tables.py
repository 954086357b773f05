"""Table building for the sweep's batched probes: :func:`frame` (one DataFrame from numpy column blocks) and
the temporal rows (step metrics and drift per item and layer, per-key rows for the kept items), vectorised
over the batch and equal, value for value, to reading the probes' results row by row."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mdm_lens.probes import run as R
from mdm_lens.sweep.batch import Batch, Settings

__all__ = ["frame", "temporal", "PATTERN_BUDGET_BYTES", "DRIFT_METRICS", "STEP_METRICS", "KEY_COLUMNS"]

from mdm_lens.probes.run import PATTERN_BUDGET_BYTES  # noqa: E402  (absorption/flow: layer groups under this)


def frame(parts: list[dict[str, Any]], columns: list[str] | None = None,
          sort_by: list[str] | None = None) -> pd.DataFrame:
    """One DataFrame from column blocks (rows in block order, or sorted by the ``sort_by`` columns): each
    block maps every column to a 1-d array or a scalar repeated over the block's rows. One frame per run
    instead of one per metric and layer: pandas' per-frame cost (str columns are converted on construction)
    dominated the table building. ``sort_by`` keys must be unique per row (then any sort gives one order);
    it sorts numpy codes (``np.unique`` order: lexicographic, as pandas sorts str) before the frame is built."""
    if not parts:
        return pd.DataFrame(columns=columns)
    sizes = [next(len(v) for v in p.values() if isinstance(v, np.ndarray)) for p in parts]
    cols = {}
    for c in parts[0]:
        blocks = []
        for p, n in zip(parts, sizes):
            v = p[c]
            blocks.append(v if isinstance(v, np.ndarray) else
                          np.full(n, v, dtype=object if v is None or isinstance(v, str) else None))
        cols[c] = np.concatenate(blocks)
    if sort_by:
        keys = [np.unique(cols[c], return_inverse=True)[1] if cols[c].dtype == object else cols[c] for c in sort_by]
        order = np.lexsort(keys[::-1])
        cols = {c: v[order] for c, v in cols.items()}
    return pd.DataFrame(cols)


DRIFT_METRICS = ("mean_jaccard", "drift_index", "n_distinct", "stability", "modal_anchor", "empty_fraction",
                 "top1_change_rate", "centroid_slope", "mean_w1")
_POSITION_METRICS = {"modal_anchor", "top1_key"}
STEP_METRICS = ("n_anchors", "top1_key", "top1_mass", "anchor_mass")
KEY_COLUMNS = ["item_id", "layer", "step", "key", "token", "token_str", "received", "anchor", "commit_step",
               "prompt_length"]


def _anchor_mass(mass: Tensor, anchors: Tensor) -> Tensor:
    """Σ of the mass on the anchors, [batch, step]: equal to ``mass[b, s][anchors[b, s]].sum()`` bit for bit
    (zeros add exactly and two terms sum the same in any order; rows with > 2 anchors are summed as there)."""
    am = torch.where(anchors, mass, torch.zeros_like(mass)).sum(-1)
    for b, si in (anchors.sum(-1) > 2).nonzero().tolist():
        am[b, si] = mass[b, si][anchors[b, si]].sum()
    return am


def _step_anchors(out: Any, n_layers: int) -> list[tuple[Any, Any]]:
    """``(anchors_over_steps(out, layer=l), drift_from_output(out, layer=l))`` per layer. When the record fits
    ``PATTERN_BUDGET_BYTES`` in float64, from ONE call of each on all layers (rows equal the per-layer calls,
    which tests/test_sweep.py checks); otherwise layer by layer, so the float64 copy stays one layer's."""
    rec = out.records["received_attention"]
    if rec.numel() * 8 > PATTERN_BUDGET_BYTES:
        return [(R.anchors_over_steps(out, layer=l), R.drift_from_output(out, layer=l)) for l in range(n_layers)]
    sa, drift = R.anchors_over_steps(out), R.drift_from_output(out)     # [batch, layer, ...]
    per = []
    for l in range(n_layers):
        sl = dataclasses.replace(sa, anchors=sa.anchors[:, l], received=sa.received[:, l], layers=[sa.layers[l]])
        dl = {m: torch.as_tensor(getattr(drift, m))[:, l] for m in DRIFT_METRICS}
        per.append((sl, types.SimpleNamespace(**dl)))
    return per


def temporal(model: Any, batch: Batch, s: Settings, shared: dict, keep: list[bool]) -> dict[str, pd.DataFrame]:
    """Per item and layer: the step metrics at every recorded step, then the drift metrics (step = NA)."""
    out = shared["out"]
    ids = np.asarray(batch.item_ids, object)
    off = torch.tensor(batch.offsets, dtype=torch.float64)
    parts, keys = [], []
    commit = out.trajectory.commit_step
    for layer, (sa, drift) in enumerate(_step_anchors(out, model.cfg.n_layers)):   # sa: [batch, step, key]
        top = sa.received.nan_to_num(-torch.inf).argmax(-1)              # [batch, step]
        mass = torch.nan_to_num(sa.received, nan=0.0)
        step_vals = torch.stack([sa.anchors.sum(-1).double(), top.double() - off[:, None],
                                 mass.gather(-1, top[..., None])[..., 0], _anchor_mass(mass, sa.anchors)], -1)
        drift_vals = torch.stack([torch.as_tensor(getattr(drift, m)).double().reshape(-1) for m in DRIFT_METRICS], -1)
        for j, m in enumerate(DRIFT_METRICS):
            if m in _POSITION_METRICS:
                v = drift_vals[:, j]
                drift_vals[:, j] = torch.where(v >= 0, v - off, torch.nan)  # the probe's -1 (no anchor) is no position
        n_steps, B = len(sa.steps), len(ids)
        vals = torch.cat([step_vals.reshape(B, -1), drift_vals], -1).cpu().numpy()       # [batch, rows per item]
        per = vals.shape[1]
        step = np.concatenate([np.repeat(np.asarray(sa.steps, float), len(STEP_METRICS)),
                               np.full(len(DRIFT_METRICS), np.nan)])
        metric = np.asarray(list(STEP_METRICS) * n_steps + list(DRIFT_METRICS), object)
        parts.append(dict(item_id=np.repeat(ids, per), layer=layer, step=np.tile(step, B), metric=np.tile(metric, B),
                          value=vals.reshape(-1)))
        for b in (b for b in range(B) if keep[b]):
            o = batch.offsets[b]
            toks = out.tokens[b, o:]
            n_keys = sa.received.shape[-1] - o
            labels = np.asarray(model.to_str_tokens(toks), object)[:n_keys]
            cs = commit[b, o:o + n_keys].cpu().numpy().astype(np.int64)
            for si, st in enumerate(sa.steps):
                keys.append(dict(item_id=ids[b], layer=layer, step=st, key=np.arange(n_keys),
                                 token=toks[:n_keys].cpu().numpy().astype(np.int64), token_str=labels,
                                 received=sa.received[b, si, o:].cpu().numpy().astype(float),
                                 anchor=sa.anchors[b, si, o:].cpu().numpy().astype(bool), commit_step=cs,
                                 prompt_length=out.prompt_length - o))
    df = frame(parts)
    df["step"] = df["step"].astype("Int64")
    return {"temporal": df, "temporal_keys": frame(keys, KEY_COLUMNS)}
