"""Resume invariants (issue #21 §3): a sweep killed at ANY point (before a unit, between a unit's part files and its
``.done`` marker, or after the merge but before the manifest) and rerun gives exactly the tables of an uninterrupted
run; every table has each key once and the input's gold sets; a higher ``--limit`` computes only the new items.
(Two real torchrun ranks vs one process: tests/test_sweep_dist.py.)"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from mdm_lens import sweep
from mdm_lens.sweep import store as S
from mdm_lens.zoo import jsonl

SEED = 34          # zoo items 0..5 of seed 34: prompt lengths 50 53 53 51 55 50
PROBES = "accuracy,absorption,temporal"
KEYS = {"accuracy": ["item_id", "condition", "metric"], "absorption": ["item_id", "mode", "layer", "variant", "metric"],
        "temporal": ["item_id", "layer", "step", "metric"], "temporal_keys": ["item_id", "layer", "step", "key"],
        "skipped": ["item_id"]}


class Killed(Exception):
    pass


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Many short forwards: on a busy 2-core machine two BLAS threads spin-wait for each other (10x slower here).
    # Every run of this module (reference and resumed) uses the same setting, so their kernels match.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    jsonl.export(path, 6, seed=SEED)
    return path


@pytest.fixture(scope="module")
def reference(mdm, data, tmp_path_factory):
    """Uninterrupted runs, one per batch size (made on first use)."""
    root, cache = tmp_path_factory.mktemp("ref"), {}

    def get(batch_size: int) -> dict[str, pd.DataFrame]:
        if batch_size not in cache:
            cache[batch_size] = sweep.run(mdm, data, PROBES, root / f"b{batch_size}", batch_size=batch_size,
                                          progress=False)
        return cache[batch_size]
    return get


def _killed_run(mdm, data, out, batch_size, kill_at, mode):
    """Run until the ``kill_at``-th unit write (0-based), killed there as ``mode`` says; ``merged``: killed after
    the merge, before the manifest. Returns True when the kill happened."""
    orig, calls = S.SweepStore.write_batch, [0]

    def write_batch(self, k, tables, ids):
        if calls[0] == kill_at and mode != "merged":
            if mode == "parts":           # the part files are written, the .done marker is not
                real = S._atomic_write
                with mock.patch.object(S, "_atomic_write",
                                       lambda p, t: (_ for _ in ()).throw(Killed()) if p.suffix == ".done"
                                       else real(p, t)):
                    orig(self, k, tables, ids)
            raise Killed()
        calls[0] += 1
        return orig(self, k, tables, ids)

    manifest = mock.patch.object(S.SweepStore, "write_manifest", side_effect=Killed()) if mode == "merged" \
        else mock.patch.object(S.SweepStore, "write_manifest", S.SweepStore.write_manifest)
    with mock.patch.object(S.SweepStore, "write_batch", write_batch), manifest:
        try:
            sweep.run(mdm, data, PROBES, out, batch_size=batch_size, progress=False)
        except Killed:
            return True
    return False


def _check_invariants(tables, items):
    gold = {it.id: ",".join(map(str, it.gold_indices)) for it in items}
    for name, keys in KEYS.items():
        df = tables[name]
        assert not df.duplicated(keys).any(), name
        if name != "skipped":
            assert set(df.item_id) == ({items[0].id} if name == "temporal_keys" else set(gold)), name
    acc = tables["accuracy"]
    assert dict(zip(acc.item_id, acc.gold_indices)) == gold
    assert (tables["accuracy"].gold_index == [it.gold_index for it in items for _ in range(6)]).all()


@settings(max_examples=12, deadline=None, derandomize=True)
@given(batch_size=st.integers(1, 3), kill_at=st.integers(0, 12), mode=st.sampled_from(["before", "parts", "merged"]))
def test_resume_after_a_kill_anywhere_equals_the_uninterrupted_run(mdm, data, reference, batch_size, kill_at, mode):
    ref = reference(batch_size)
    out = Path(tempfile.mkdtemp(prefix="resume"))
    try:
        killed = _killed_run(mdm, data, out, batch_size, kill_at, mode)
        assert killed or mode != "merged"
        assert not (out / "manifest.json").exists() or not killed
        n_done_before = len(list((out / "parts").glob("*.done")))
        tabs = sweep.run(mdm, data, PROBES, out, batch_size=batch_size, progress=False)
        assert sorted(tabs) == sorted(ref)
        for name in ref:
            pd.testing.assert_frame_equal(tabs[name], ref[name], check_exact=True)
        man = json.loads((out / "manifest.json").read_text())
        n_units = len(json.loads((out / "parts" / "plan.json").read_text())["units"])
        assert man["items_done"] == 6 and man["ranks"][0]["batches"] == n_units - n_done_before
        _check_invariants(tabs, sweep.read_items(data).items)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_raising_the_limit_computes_only_the_new_items(mdm, data, reference, tmp_path):
    items = sweep.read_items(data).items
    out = tmp_path / "grow"
    sweep.run(mdm, data, PROBES, out, batch_size=2, limit=3, progress=False)
    tabs = sweep.run(mdm, data, PROBES, out, batch_size=2, limit=6, progress=False)
    man = json.loads((out / "manifest.json").read_text())
    assert man["ranks"][0]["items"] == 3 and man["items_done"] == 6      # items 3..5 only
    assert man["asked"]["limit"] == 6 and man["data"]["selected"] == 6
    _check_invariants(tabs, items)
    ref = reference(2)
    for name in ("accuracy", "absorption", "temporal", "temporal_keys"):
        # other batches than the one-shot run: equal up to fp rounding (batch shapes pick BLAS kernels; temporal's
        # received-attention reduction depends on the batch size, ~1e-8)
        pd.testing.assert_frame_equal(tabs[name], ref[name], check_exact=False, rtol=0,
                                      atol=1e-6 if name.startswith("temporal") else 1e-9)
    # a lower limit keeps the first items; only an item whose unit holds items past the limit is run again (item 1:
    # its unit is [1, 2]); raising the limit again reuses the first units and duplicates nothing
    small = sweep.run(mdm, data, PROBES, out, batch_size=2, limit=2, progress=False)
    man = json.loads((out / "manifest.json").read_text())
    assert man["ranks"][0]["items"] == 1 and set(small["accuracy"].item_id) == {items[0].id, items[1].id}
    again = sweep.run(mdm, data, PROBES, out, batch_size=2, progress=False)
    assert json.loads((out / "manifest.json").read_text())["ranks"][0]["items"] == 0
    _check_invariants(again, items)
    for name in ("accuracy", "absorption", "temporal"):
        pd.testing.assert_frame_equal(again[name], tabs[name], check_exact=True)


def test_plan_keeps_old_units_and_numbers_new_ones_after_them():
    old = [("batch", ["a", "b"]), ("book", ["a", "b"]), ("batch", ["a"])]        # unit 2 re-covers "a": not used
    plan = sweep.runner.extend_plan(old, ["a", "b", "c", "d"], [5, 5, 7, 5], [3, 3, 3, 3], 2, "length")
    assert plan.units[:3] == old and plan.active == [0, 1, 3, 4]
    assert plan.units[3:] == [("batch", ["d", "c"]), ("book", ["c", "d"])]
    fresh = sweep.runner.extend_plan([], ["a", "b"], [5, 5], None, 2, "length")
    assert fresh.units == [("batch", ["a", "b"])] and fresh.active == [0]
