"""`mdm-lens sweep` and `mdm-lens report` on the tiny Nemotron-Labs-Diffusion checkpoint (hub layout, character
tokenizer): every probe on its 'nemotron' sampler. The lens reads the run's own cached residuals and knockout cuts
and scores the run's own denoising forwards; the causal prefill / commit steps and the teacher-forced metrics are
NaN with the reason in `note`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from nemotron_fixture import write_nemotron
from test_family_sweep import ITEMS, _char_tokenizer

from mdm_lens.cli import main
from mdm_lens.probes.knockout_windowed import not_applicable

PROBES = "accuracy,temporal,absorption,features,cache,retrieval,qk,flow,lens,knockout"


def test_sweep_and_report_run_on_nemotron(tmp_path):
    folder = write_nemotron(tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", PROBES + ",atp", "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "4", "--block-length", "4", "--template", "zoo",
                 "--no-progress"]) == 0
    for probe in PROBES.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == {"a", "b"}, probe
    _check_lens_and_knockout(out)
    cache = pd.read_parquet(out / "cache.parquet")  # Fast-dLLM's prefix/dual caches only: said, not an internal error
    assert cache["value"].isna().all() and cache["reason"].str.startswith("not applicable").all()
    atp = pd.read_parquet(out / "atp.parquet")  # every step reads the prompt through a cache: NaN, the reason noted
    assert len(atp) > 0 and atp["value"].isna().all() and atp["reason"].str.contains("KV cache").all()
    feats = pd.read_parquet(out / "features.parquet")  # each step's own forward replayed (window_replay)
    assert not feats["note"].str.contains("not replayable").any()
    assert feats["feature"].map(lambda f: f is not None and bool(np.isfinite(np.asarray(f)).all())).any()
    assert main(["report", str(out)]) == 0
    assert any((out / "report").iterdir())


def _check_lens_and_knockout(out):
    lens = pd.read_parquet(out / "lens.parquet")
    acc = lens[lens["metric"] == "acc_all"]
    # one block of 4: step 0 the causal prefill, 1-3 denoising forwards (slot 0 is the seed), 4 the causal commit
    assert sorted(acc["step"].unique()) == [0, 1, 2, 3, 4]
    assert acc.loc[acc["step"].isin([1, 2, 3]), "value"].notna().all()
    causal = acc[acc["step"].isin([0, 4])]
    assert causal["value"].isna().all()
    assert set(causal["note"]) == {
        "step 0 is Nemotron's causal prefill forward (it fills the KV cache and seeds a block's first token), no "
        "denoising step", "step 4 is Nemotron's causal commit forward (it fills the KV cache and seeds a block's "
        "first token), no denoising step"}
    knock = pd.read_parquet(out / "knockout.parquet")
    for metric in ("answer_logprob", "answer_rank", "exact_match", "agreement", "effect"):
        assert knock.loc[knock["metric"] == metric, "value"].notna().all(), metric
    n_targets = knock[(knock["metric"] == "n_targets") & (knock["condition"] == "anchors")]
    assert sorted(n_targets["step"].unique()) == [0, 1, 2, 3]  # the grid: gen_length denoising forwards at most
    assert n_targets.loc[n_targets["step"] < 3, "value"].notna().all()  # steps 0-2 ran (3 masks after the seed)
    assert n_targets.loc[n_targets["step"] == 3, "value"].isna().all()
    assert n_targets.loc[n_targets["step"] == 3, "note"].str.startswith("steps [3] were not reached").all()
    tf = knock[knock["metric"].str.startswith("tf_")]
    assert len(tf) > 0 and tf["value"].isna().all()
    assert (tf["note"] == not_applicable("nemotron", {})).all()
