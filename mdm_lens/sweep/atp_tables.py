"""The ``atp`` sweep probe: attribution patching (:mod:`mdm_lens.probes.attribution`) of every item's own run.

The corruption is the anchors' attention knockout (``corrupt="knockout"``): every item has it, whereas a
corrupted prompt of the same length (a gold passage swapped for another of equal token count) is something the
data rarely supports.  Direction noising, metric ``logprob`` (mean log-prob of the tokens the clean run commits
at the step): the value estimates "what does knocking the anchors out do *through this component*".  Exact
patching runs beside it when the item's grid is small (:data:`EXACT_BUDGET` forwards), else ``exact`` is NaN with
the reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from mdm_lens.probes import attribution as AT
from mdm_lens.sweep.batch import Batch, Settings

__all__ = ["atp", "EXACT_BUDGET", "NO_EXACT"]

EXACT_BUDGET = 512      # forwards per item (steps × layers × (3 + heads)) up to which exact patching runs too
NO_EXACT = f"exact patching not run: the item's grid needs more than {EXACT_BUDGET} forwards"


def _one(model: Any, ids: torch.Tensor, s: Settings, seed: int, gen_kwargs: dict) -> pd.DataFrame:
    out = model.generate(ids[None].to(model.input_device), seed=seed, **gen_kwargs)
    cells = out.n_steps * model.cfg.n_layers * (3 + model.cfg.n_heads)
    fn = AT.atp_vs_patching if cells <= EXACT_BUDGET else AT.attribution_patching
    df = fn(model, out, "knockout", metric="logprob").to_frame()
    if "exact" not in df:
        df["exact"] = np.nan
        df["reason"] = df["reason"].where(df["reason"] != "", NO_EXACT)
    df["metric"] = "atp"
    return df[["step", "component", "layer", "head", "metric", "value", "exact", "reason"]]


def atp(model: Any, batch: Batch, s: Settings, shared: dict, gen_kwargs: dict) -> pd.DataFrame:
    """Rows per item: (step, component, layer, head) with the AtP estimate and, where run, the exact effect."""
    frames = []
    for b, r in enumerate(batch.rendered):
        df = _one(model, torch.tensor(r.ids, dtype=torch.long), s, batch.seeds[b], gen_kwargs)
        df.insert(0, "item_id", batch.item_ids[b])
        frames.append(df)
    return pd.concat(frames, ignore_index=True)
