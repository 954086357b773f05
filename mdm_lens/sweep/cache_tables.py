"""The sweep's ``cache`` probe: what Fast-dLLM's approximate KV caches change, item by item.

Each item's prompt (its own rows, unpadded: the cached loops take prompts of one length) is decoded again with
``kv_cache="prefix"`` and ``kv_cache="dual"`` under the sweep's sampler settings and seed, and
:func:`mdm_lens.probes.cache_effect` compares every window step's cached forward with a fresh one
(``patch=False``: the per-layer patching costs a forward per layer and step; run the probe itself for it). Rows,
keyed by ``(item_id, kv_cache)``:

* per (step, layer): ``k_drift``, ``v_drift``, ``k_cosine``, ``v_cosine``, ``received_tv``, ``anchor_jaccard``
  (NaN with a ``reason`` when both anchor sets are empty);
* per step (``layer`` ``<NA>``: the whole model, not one layer; the probe's own table writes -1 there, which
  elsewhere means *the last layer*, so it is replaced): ``logprob_fresh``, ``logprob_cached``, ``logprob_delta`` of the run's final tokens at
  the window's masked positions;
* per item (``step`` and ``layer`` NA): ``answer_changed`` (share of the generated positions whose token differs
  from the same prompt decoded without a cache, same settings and seed: the sampler's own loop, which differs from
  Fast-dLLM's uncached loop only in float32 vs float64 confidences) and ``forwards`` (the cached run's forwards).

With the block schedule the cached loops need two steps per block at least; other settings give one NaN row per
item with the reason, as do causal (ARM) models, which have no masked canvas.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mdm_lens.errors import SamplerConfigError
from mdm_lens.probes.cache_effect import cache_effect

__all__ = ["cache", "COLUMNS", "MODES"]

COLUMNS = ["item_id", "kv_cache", "step", "block", "layer", "metric", "value", "reason"]
MODES = ("prefix", "dual")


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    for c in ("step", "block", "layer"):
        df[c] = df[c].astype("Int64")
    df["value"] = df["value"].astype(float)
    df["reason"] = df["reason"].astype("string")
    return df[COLUMNS]


def _no_layer(table: pd.DataFrame) -> pd.DataFrame:
    """The probe marks whole-model rows with ``layer=-1``; in a table -1 reads as the last layer, so <NA>."""
    layer = table["layer"].astype("Int64")
    table["layer"] = layer.mask(layer == -1)
    return table


def _na(item_id: str, mode: str, reason: str) -> dict:
    return dict(item_id=item_id, kv_cache=mode, step=pd.NA, block=pd.NA, layer=pd.NA, metric="answer_changed",
                value=np.nan, reason=reason)


def _has_fast_dllm_cache(sampler: str) -> bool:
    """Whether `sampler` takes Fast-dLLM's approximate caches (`kv_cache="prefix"` / `"dual"`, default None)."""
    import dataclasses

    from mdm_lens.diffusion import registry

    plugin = registry.get(sampler)
    fields = {f.name: f.default for f in dataclasses.fields(plugin.Settings)}
    return "kv_cache" in fields and fields["kv_cache"] is None and not getattr(plugin, "no_kv_cache", "")


def cache(model: Any, batch: Any, s: Any, shared: dict) -> pd.DataFrame:
    from mdm_lens.diffusion import registry

    out = shared["out"]
    parts: list[pd.DataFrame] = []
    rows: list[dict] = []
    own = getattr(registry.get(out.sampler), "no_kv_cache", "")
    no_cache = None if out.causal or _has_fast_dllm_cache(out.sampler) else (
        f"not applicable: the cache probe compares Fast-dLLM's approximate prefix / dual KV caches, which the "
        f"{out.sampler!r} sampler does not have ({own or 'its own cache, if any, is part of its algorithm'})")
    for row, item_id in enumerate(batch.item_ids):
        for mode in MODES:
            if out.causal:
                rows.append(_na(item_id, mode, "causal (ARM) model: no KV-cached diffusion loop"))
                continue
            if no_cache is not None:
                rows.append(_na(item_id, mode, no_cache))
                continue
            prompt = batch.ids[row:row + 1, batch.offsets[row]:]
            try:
                cached = model.generate(prompt, gen_length=s.gen_length, steps=s.steps, block_length=s.block_length,
                                        kv_cache=mode, seed=batch.seeds[row], progress=False)
            except SamplerConfigError as e:
                rows.append(_na(item_id, mode, f"not run: {e}"))
                continue
            table = _no_layer(cache_effect(model, cached, patch=False).table)
            table.insert(0, "kv_cache", mode)
            table.insert(0, "item_id", item_id)
            parts.append(table)
            if mode == MODES[0]:
                fresh = model.generate(prompt, gen_length=s.gen_length, steps=s.steps, block_length=s.block_length,
                                       seed=batch.seeds[row], progress=False).generated[0].cpu()
            changed = (cached.generated[0].cpu() != fresh).double().mean()
            base = dict(item_id=item_id, kv_cache=mode, step=pd.NA, block=pd.NA, layer=pd.NA, reason="")
            rows.append(dict(base, metric="answer_changed", value=float(changed)))
            rows.append(dict(base, metric="forwards", value=float(cached.trajectory.n_steps)))
    parts.append(pd.DataFrame(rows, columns=COLUMNS))
    return _finish(pd.concat([p for p in parts if len(p)], ignore_index=True))
