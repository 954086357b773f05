"""`mdm-lens sweep` and `mdm-lens report` on the tiny Nemotron-Labs-Diffusion checkpoint (hub layout, character
tokenizer): the probes that run on its 'nemotron' sampler (the lens and knockout probes do not know it yet)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from nemotron_fixture import write_nemotron
from test_family_sweep import ITEMS, _char_tokenizer

from mdm_lens.cli import main

PROBES = "accuracy,temporal,absorption,features,cache,retrieval,qk,flow"


def test_sweep_and_report_run_on_nemotron(tmp_path):
    folder = write_nemotron(tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", PROBES, "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "4", "--block-length", "4", "--template", "zoo",
                 "--no-progress"]) == 0
    for probe in PROBES.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == {"a", "b"}, probe
    feats = pd.read_parquet(out / "features.parquet")  # each step's own forward replayed (window_replay)
    assert not feats["note"].str.contains("not replayable").any()
    assert feats["feature"].map(lambda f: f is not None and bool(np.isfinite(np.asarray(f)).all())).any()
    assert main(["report", str(out)]) == 0
    assert any((out / "report").iterdir())
