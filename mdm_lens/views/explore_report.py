"""The step explorer in `mdm-lens report`: built from a sweep's `temporal_keys` table, not from a rerun.

The table holds, for the items the sweep keeps key-level rows for, each recorded step's head-mean received
attention per key and layer, the sweep's anchors (its own rule) and each key's commit step: the explorer's data
without the heads. The chosen item is the first kept item that every model of the report has (so their sliders
are linked), else each model's own first item; past `max_steps` steps are evenly thinned (said on screen).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from mdm_lens.views.explore import Explorer, _shown_steps
from mdm_lens.views.report import Section

#: the demo's report with one explorer per model stays far below the 10 MB budget at this many steps
REPORT_MAX_STEPS = 48


def run_data_from_keys(keys: pd.DataFrame, item_id: str, *, label: str, n_steps: int | None,
                       block_length: int | None, max_steps: int = REPORT_MAX_STEPS) -> dict:
    """Explorer data (see `views.explore`) of one item from a `temporal_keys` table."""
    rows = keys[keys["item_id"] == item_id]
    layers = sorted(int(v) for v in rows["layer"].unique())
    all_steps = sorted(int(v) for v in rows["step"].unique())
    total = int(n_steps) if n_steps else max(all_steps) + 1
    recorded = set(all_steps)
    steps = [s for s in _shown_steps(total, max_steps) if s in recorded] or all_steps[:max_steps]
    notes = ["head mean only: the sweep table keeps the head-mean received attention"]
    if len(steps) < len(all_steps):
        notes.append(f"{len(all_steps)} recorded steps > {max_steps}: {len(steps)} evenly spaced steps shown")
    first = rows[(rows["layer"] == layers[0]) & (rows["step"] == all_steps[0])].sort_values("key")
    n_keys = len(first)
    by = {(int(l), int(s)): g.sort_values("key") for (l, s), g in rows.groupby(["layer", "step"])}

    def series(layer: int, step: int, col: str) -> Any:
        g = by.get((layer, step))
        if g is None or len(g) != n_keys:
            return None
        return g[col].to_numpy()

    values, anchors = [], []
    for s in steps:
        vals = [series(l, s, "received") for l in layers]
        values.append([[[None if not np.isfinite(v) else float(f"{v:.5g}") for v in r]] if r is not None else [[]]
                       for r in vals])
        anchors.append([[np.flatnonzero(a.astype(bool)).tolist()] if (a := series(l, s, "anchor")) is not None
                        else [[]] for l in layers])
    commit = [int(c) for c in first["commit_step"].fillna(-1)]
    return dict(label=label, sampler="sweep", n_steps=total, steps=steps, notes=notes,
                tokens=[str(t) for t in first["token_str"]], commit_step=commit, pad=[False] * n_keys,
                block_of_step=[0] * total, block_length=None,  # the table has no per-step block
                prompt_length=int(first["prompt_length"].iloc[0]),
                received=dict(layers=layers, heads=["mean"], values=values, kind="mass"), anchors=anchors,
                kv_age=None, patterns=None, lens=None)


def _choose_item(tables: Sequence[pd.DataFrame]) -> list[str]:
    firsts = [list(dict.fromkeys(t["item_id"])) for t in tables]
    common = [i for i in firsts[0] if all(i in f for f in firsts[1:])]
    return [common[0]] * len(tables) if common else [f[0] for f in firsts]


def explorer_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    """One explorer for all models on a shared item (linked step sliders), else one per model."""
    tables = [s.table("temporal_keys") for s in sweeps]
    items = _choose_item(tables)
    data = []
    for s, t, item in zip(sweeps, tables, items):
        args = s.manifest.get("arguments", {})
        data.append(run_data_from_keys(t, item, label=f"{s.label} · item {item}", n_steps=args.get("steps"),
                                       block_length=args.get("block_length")))
    shared = len(set(items)) == 1
    explorers = [Explorer(data, "Step explorer")] if shared else [Explorer([d], "Step explorer") for d in data]
    text = ("Drag the step slider (or press play) to see each step's canvas: tokens coloured by the step that "
            "committed them, [MASK] where not yet committed, the head-mean attention each key receives in the chosen "
            "layer as a bar, and the step's anchors in red. ")
    text += (f"All models show item {items[0]}, with one slider." if shared else
             "The models share no item with key-level rows, so each has its own explorer.")
    return Section("Step explorer", text, html=[e.fragment(show_title=False) for e in explorers])
