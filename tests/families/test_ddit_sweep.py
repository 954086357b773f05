"""`mdm-lens sweep` (every probe) and `mdm-lens report` on tiny MDLM and Duo checkpoints in their hub layouts, with
the character-level tokenizer of the family sweeps (test_family_sweep.py). Duo has no mask token: its probes read
the generated positions as the noisy ones (mdm_lens.noisy)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit
from test_family_sweep import ITEMS, PROBES, _char_tokenizer

from mdm_lens.cli import main


@pytest.mark.parametrize("family", ["mdlm", "duo"])
def test_sweep_and_report_run_on_the_family(tmp_path, family):
    config = dict(MDLM_CONFIG if family == "mdlm" else DUO_CONFIG, vocab_size=101, model_length=128)
    folder, _ = write_ddit(tmp_path / "ckpt", config, seed=3)
    _char_tokenizer(folder)  # ids 0..94 printable; MDLM's mask is its last id, 100 = the tokenizer's <|mask|>
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", PROBES, "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "2", "--template", "zoo", "--no-progress"]) == 0
    for probe in PROBES.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == {"a", "b"}, probe
    notes = json.loads((out / "manifest.json").read_text())["model"]["notes"]
    assert (notes == []) if family == "mdlm" else ("no [MASK] token" in notes[0])
    knock = pd.read_parquet(out / "knockout_summary.parquet") if (out / "knockout_summary.parquet").exists() else None
    assert knock is None or len(knock) > 0
    assert main(["report", str(out)]) == 0
    assert any((out / "report").iterdir())
