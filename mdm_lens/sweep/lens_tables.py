"""The sweep's ``lens`` probe: the logit lens over the denoising steps of each run, as one long table.

Rows of two kinds, keyed by ``item_id``:

* per (item, step, layer), ``answer_position`` NA: ``acc_masked`` (share of the canvas positions still masked in
  that step's input whose lens top-1 is the final token: known before decoded), ``acc_all`` (all canvas
  positions), ``final_prob_masked`` (mean lens probability of the final token over the masked positions) and
  ``n_masked``; NaN with a ``note`` where no position is masked;
* per (item, layer, answer_position), ``step`` NA: ``emergence_step`` (first step from which the layer's top-1 is
  the final token and stays so up to the commit, see :func:`mdm_lens.lens.answer_emergence`), ``commit_step`` and
  ``lead``; NaN with the reason in ``note``. ``answer`` marks the positions before the first stop token
  (EOS / EoT / pad), i.e. the answer's own tokens.

``answer_position`` counts from the first generated token, so it does not depend on the batch's padding. The
residuals come from replaying each step of the shared sampler run (one extra forward per step); on nemotron and
bd3lm (windowed forwards) from the run itself (the shared run then caches every layer's residual,
``run_cache``), and a step that is no denoising forward (nemotron's prefill / commit, bd3lm's storing forward) has
NaN rows with the reason in ``note``. Causal (ARM) models have no masked canvas: one row per item with NaN and the
reason in ``note``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from mdm_lens.lens import answer_emergence, lens_trace
from mdm_lens.lens.trace import lens_refusal

__all__ = ["lens", "STEP_METRICS", "EMERGENCE_METRICS", "COLUMNS"]

STEP_METRICS = ("acc_masked", "acc_all", "final_prob_masked", "n_masked")
EMERGENCE_METRICS = ("emergence_step", "commit_step", "lead")
COLUMNS = ["item_id", "step", "layer", "answer_position", "answer", "metric", "value", "note"]
_INT = ("step", "layer", "answer_position")


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    for c in _INT:
        df[c] = df[c].astype("Int64")
    df["answer"] = df["answer"].astype("boolean")
    df["note"] = df["note"].astype("string")
    df["value"] = df["value"].astype(float)
    return df[COLUMNS]


def _stop_ids(model: Any) -> set[int]:
    c = model.cfg
    return {c.eos_token_id, c.pad_token_id, c.extra.get("eot_token_id")} - {None}


def run_cache(model: Any) -> list[str] | None:
    """What the shared run caches so the lens can read a windowed sampler (nemotron, bd3lm): every layer's
    residual (+ the σ a time-conditioned DDiT's readout needs); None for the other samplers."""
    from mdm_lens.diffusion.generate import default_sampler
    from mdm_lens.lens.trace import RUN_ONLY

    if default_sampler(model) not in RUN_ONLY:
        return None
    sigma = callable(getattr(model, "readout", None)) and model.cfg.extra.get("time_conditioning", False)
    return ["blocks.*.hook_resid_post"] + (["hook_sigma"] if sigma else [])


def lens(model: Any, batch: Any, s: Any, shared: dict) -> pd.DataFrame:
    out = shared["out"]
    ids = list(batch.item_ids)
    why = lens_refusal(out)  # causal (ARM) models, samplers a replay cannot rebuild (BD3LM): one NaN row per item
    if why is not None:
        return _finish(pd.DataFrame({"item_id": ids, "step": pd.NA, "layer": pd.NA, "answer_position": pd.NA,
                                     "answer": pd.NA, "metric": "acc_masked", "value": np.nan, "note": why}))
    trace = lens_trace(model, out)             # every step, layer and canvas position (answer[b, p] relies on it)
    return pd.concat([_step_rows(trace, ids), _emergence_rows(model, trace, ids)], ignore_index=True)


def _step_rows(trace: Any, ids: list[str]) -> pd.DataFrame:
    masked = trace.masked[:, None].expand_as(trace.correct)                      # [step, layer, batch, pos]
    n = masked.sum(-1).double()
    prob = torch.where(n > 0, (trace.final_prob.double() * masked).sum(-1) / n.clamp(min=1), torch.nan)
    values = {"acc_masked": trace.accuracy("masked"), "acc_all": trace.accuracy("all"),
              "final_prob_masked": prob, "n_masked": n}
    S, L, B = n.shape
    si, li, bi = np.indices((S, L, B)).reshape(3, -1)
    parts = []
    for metric in STEP_METRICS:
        v = values[metric].numpy()[si, li, bi].astype(float)
        # a step that is no denoising forward (nemotron / bd3lm, lens.run_only) says so; else none is masked
        why = np.asarray([trace.meta.get("step_notes", {}).get(st, "no position is masked at this step")
                          for st in trace.steps], object)[si]
        note = np.where(np.isnan(v), why, None).astype(object)
        parts.append(pd.DataFrame({"item_id": np.asarray(ids, object)[bi], "step": np.asarray(trace.steps)[si],
                                   "layer": np.asarray(trace.layers)[li], "answer_position": pd.NA, "answer": pd.NA,
                                   "metric": metric, "value": v, "note": note}))
    return _finish(pd.concat(parts, ignore_index=True))


def _emergence_rows(model: Any, trace: Any, ids: list[str]) -> pd.DataFrame:
    em = answer_emergence(trace)
    final = trace.final_tokens
    stops = torch.tensor(sorted(_stop_ids(model)), dtype=final.dtype)
    is_stop = torch.isin(final, stops) if len(stops) else torch.zeros_like(final, dtype=torch.bool)
    answer = (is_stop.long().cumsum(-1) == 0).numpy()                           # before the first stop token
    b, p = em["batch"].to_numpy(int), em["position"].to_numpy(int)
    parts = []
    for metric in EMERGENCE_METRICS:
        v = em[metric].astype("Float64").to_numpy(dtype=float, na_value=np.nan)
        note = em["note"].astype(object).where(em["note"].notna(), None).to_numpy()
        if metric != "emergence_step":                  # commit NA: never committed (lead is then NA too)
            never = em["commit_step"].isna().to_numpy()
            note = np.where(never, "never committed", note if metric == "lead" else None).astype(object)
        parts.append(pd.DataFrame({"item_id": np.asarray(ids, object)[b], "step": pd.NA, "layer": em["layer"],
                                   "answer_position": em["position"], "answer": answer[b, p],
                                   "metric": metric, "value": v, "note": note}))
    return _finish(pd.concat(parts, ignore_index=True))
