"""`mdm-lens sweep` across processes: a real 2-rank gloo torchrun resuming a killed 1-process run gives the same
tables as 1 uninterrupted process, and a run killed mid-way resumes with no lost or duplicated rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from mdm_lens import sweep
from mdm_lens.zoo import jsonl

REPO = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def _tables(folder: Path) -> dict[str, pd.DataFrame]:
    return {p.stem: pd.read_parquet(p) for p in sorted(folder.glob("*.parquet"))}


def test_two_gloo_ranks_resuming_a_killed_one_process_run_give_its_rows(mdm, tmp_path):
    """A one-process run killed after 2 units, resumed by a real 2-rank gloo torchrun: the rows of one
    uninterrupted process (so world size is neither in the rows nor in the resume)."""
    from unittest import mock

    from mdm_lens.sweep import store as S

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 6, seed=34)
    probes = "accuracy,absorption,temporal"
    orig, calls = S.SweepStore.write_batch, [0]

    def write_batch(self, k, tables, ids):
        if calls[0] == 2:
            raise KeyboardInterrupt("planted kill")
        calls[0] += 1
        return orig(self, k, tables, ids)

    with mock.patch.object(S.SweepStore, "write_batch", write_batch):
        try:
            sweep.run(mdm, data, probes, tmp_path / "two", batch_size=2, progress=False)
        except KeyboardInterrupt:
            pass
    plan = json.loads((tmp_path / "two" / "parts" / "plan.json").read_text())["units"]
    done = [int(p.name[1:7]) for p in (tmp_path / "two" / "parts").glob("b*.done")]
    assert len(done) == 2
    args = ["--model", "mdm-lens/tiny-mdm", "--data", str(data), "--probes", probes, "--batch-size", "2",
            "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mdm_lens.sweep", *args, "--out", str(tmp_path / "two")]
    ran = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    sweep.run(mdm, data, probes, tmp_path / "one", batch_size=2, progress=False)
    two, one = _tables(tmp_path / "two"), _tables(tmp_path / "one")
    assert sorted(two) == sorted(one) and len(one["absorption"]) == 6 * 4 * 2 * 3 + 6 * 4 * 2 + 6 * 4 * 3 * 2
    for name in one:
        pd.testing.assert_frame_equal(two[name], one[name], check_exact=True)
    man = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert man["world_size"] == 2 and [r["rank"] for r in man["ranks"]] == [0, 1]
    before = sum(len(plan[k]["ids"]) for k in done if plan[k]["kind"] == "batch")
    assert sum(r["items"] for r in man["ranks"]) == 6 - before and man["items_done"] == 6
    assert sum(r["batches"] for r in man["ranks"]) == len(plan) - 2 and all(r["batches"] > 0 for r in man["ranks"])


def test_killed_run_resumes_without_lost_or_duplicated_rows(mdm, tmp_path):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 16, seed=7)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mdm_lens.sweep", "--model", "mdm-lens/tiny-mdm", "--data", str(data),
           "--probes", "absorption,temporal", "--batch-size", "1", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "parts").glob("*.done"))) < 3 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list((out / "parts").glob("*.done")))
    assert 3 <= done_before < 16 and not (out / "manifest.json").exists()
    # a batch cut off mid-write leaves parts without a .done marker: they must not count, and get rewritten
    first = sorted((out / "parts").glob("b*.absorption.parquet"))[0]
    stray = out / "parts" / "b000015.absorption.parquet"
    stray.write_bytes(first.read_bytes())
    tabs = sweep.run(mdm, data, "absorption,temporal", out, batch_size=1, progress=False)
    man = json.loads((out / "manifest.json").read_text())
    assert man["items_done"] == 16 and man["ranks"][0]["batches"] == 16 - done_before
    fresh = sweep.run(mdm, data, "absorption,temporal", tmp_path / "fresh", batch_size=1, progress=False)
    for name in ("absorption", "temporal", "temporal_keys"):
        pd.testing.assert_frame_equal(tabs[name], fresh[name], check_exact=True)
    keys = ["item_id", "layer", "mode", "variant", "metric"]
    assert not tabs["absorption"].duplicated(keys).any() and tabs["absorption"].item_id.nunique() == 16
