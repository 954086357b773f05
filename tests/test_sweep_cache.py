"""The sweep's ``cache`` probe: per item and cache mode, the rows equal `probes.cache_effect` on that item decoded
alone with the cache; the answer change is measured against the same prompt decoded without a cache."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from mdm_lens import sweep
from mdm_lens.probes import cache_effect
from mdm_lens.sweep import cache_tables
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT


@pytest.fixture(scope="module")
def run(mdm, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    items = jsonl.export(path, 3, seed=41)
    out = tmp_path_factory.mktemp("sweep")
    tables = sweep.run(mdm, path, "cache", out, batch_size=3, steps=4, progress=False)
    assert (out / "cache.parquet").is_file()
    return items, tables["cache"]


def test_rows_equal_the_probe_on_the_item_alone(mdm, run):
    items, table = run
    assert list(table.columns) == cache_tables.COLUMNS
    assert {str(table[c].dtype) for c in ("step", "block", "layer")} == {"Int64"}
    g = mdm.cfg.extra["gen_length"]
    for k, qa in enumerate(items):
        item_id = f"zoo-41-{k:05d}"
        ids = torch.tensor(ZT.encode(qa.prompt))[None]
        plain = mdm.generate(ids, gen_length=g, steps=4)
        for mode in cache_tables.MODES:
            rows = table[(table.item_id == item_id) & (table.kv_cache == mode)]
            out = mdm.generate(ids, gen_length=g, steps=4, kv_cache=mode)
            alone = cache_effect(mdm, out, patch=False).table
            probe_rows = rows[rows.step.notna()].reset_index(drop=True)
            assert len(probe_rows) == len(alone) > 0
            pd.testing.assert_series_equal(probe_rows["metric"], alone["metric"], check_names=False)
            assert ((probe_rows["value"] - alone["value"]).abs().fillna(0) <= 1e-9).all()
            assert probe_rows["value"].isna().equals(alone["value"].isna())
            per_item = rows[rows.step.isna()].set_index("metric")["value"]
            changed = float((out.generated != plain.generated).double().mean())
            assert per_item["answer_changed"] == changed and per_item["forwards"] == out.trajectory.n_steps


def test_an_arm_sweep_gives_nan_rows_with_the_reason(arm, tmp_path):
    path = tmp_path / "items.jsonl"
    jsonl.export(path, 2, seed=3)
    table = sweep.run(arm, path, "cache", tmp_path / "o", progress=False)["cache"]
    assert len(table) == 4 and table["value"].isna().all()
    assert table["reason"].str.contains("causal").all()


def test_whole_model_rows_have_no_layer_not_minus_one(run):
    """-1 reads as *the last layer* everywhere else: the per-step log-prob rows carry layer <NA>."""
    _, table = run
    whole = table.metric.isin(["logprob_fresh", "logprob_cached", "logprob_delta"])
    assert whole.any() and table.loc[whole, "layer"].isna().all()
    assert (table.loc[table.layer.notna(), "layer"] >= 0).all()
    assert table.loc[table.metric == "k_drift", "layer"].notna().all()
