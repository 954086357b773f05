"""`mdm-lens sweep` (every probe) and `mdm-lens report` on tiny MDLM and Duo checkpoints in their hub layouts, with
the character-level tokenizer of the family sweeps (test_family_sweep.py). Duo has no mask token: its probes read
the generated positions as the noisy ones (mdm_lens.noisy); GIDD (p_uniform 0.1) reads [MASK] and the generated
positions. BD3LM's steps forward one block against the stored ones, and lens and knockout read
the run itself (its cached residuals, its own forwards cut and scored); what they cannot give is NaN with the reason
in `note`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from bd3gidd_checkpoints import BD3LM_CONFIG, GIDD_CONFIG, write_bd3lm, write_gidd
from ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit
from test_family_sweep import ITEMS, PROBES, _char_tokenizer

from mdm_lens.cli import main
from mdm_lens.probes.knockout_windowed import not_applicable


def _write(folder, family):
    if family == "bd3lm":  # block_size 4, time_conditioning off, sampling eps 0.05 / 0.8 (not the defaults)
        return write_bd3lm(folder, dict(BD3LM_CONFIG, vocab_size=101, model_length=128), seed=3)[0]
    if family == "gidd":  # p_uniform 0.1, t_eps 1e-4
        return write_gidd(folder, dict(GIDD_CONFIG, vocab_size=101, max_seq_len=128), seed=3)[0]
    config = dict(MDLM_CONFIG if family == "mdlm" else DUO_CONFIG, vocab_size=101, model_length=128)
    return write_ddit(folder, config, seed=3)[0]


@pytest.mark.parametrize("family", ["mdlm", "duo", "bd3lm", "gidd"])
def test_sweep_and_report_run_on_the_family(tmp_path, family):
    folder = _write(tmp_path / "ckpt", family)
    _char_tokenizer(folder)  # ids 0..94 printable; MDLM's mask is its last id, 100 = the tokenizer's <|mask|>
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    probes = PROBES + ",atp"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", probes, "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "2", "--template", "zoo", "--no-progress"]) == 0
    for probe in probes.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == {"a", "b"}, probe
    notes = json.loads((out / "manifest.json").read_text())["model"]["notes"]
    if family in ("mdlm", "bd3lm"):
        assert notes == []
    else:
        assert ("no [MASK] token" if family == "duo" else "hybrid mask/uniform") in notes[0]
    atp = pd.read_parquet(out / "atp.parquet")  # BD3LM without kv_cache: each step is a canvas forward at its σ
    assert atp["value"].notna().any() and atp.loc[atp["value"].isna(), "reason"].str.len().gt(0).all()
    if family == "bd3lm":  # read from the run itself (lens.run_only, probes.knockout_windowed): values, NaN noted
        _check_bd3lm_tables(out)
        feats = pd.read_parquet(out / "features.parquet")  # replayed windows: pooled residuals, not a refusal
        assert not feats["note"].str.contains("not replayable").any()
        assert feats["feature"].map(lambda f: f is not None and bool(np.isfinite(np.asarray(f)).all())).any()
    knock = pd.read_parquet(out / "knockout_summary.parquet") if (out / "knockout_summary.parquet").exists() else None
    assert knock is None or len(knock) > 0
    assert main(["report", str(out)]) == 0
    assert any((out / "report").iterdir())


def _check_bd3lm_tables(out):
    lens = pd.read_parquet(out / "lens.parquet")
    for metric in ("acc_all", "n_masked"):  # every step of a 2-step block run is a denoising forward (no kv_cache)
        rows = lens[lens["metric"] == metric]
        assert len(rows) > 0 and rows["value"].notna().all(), metric
    assert lens.loc[lens["value"].isna(), "note"].notna().all()
    knock = pd.read_parquet(out / "knockout.parquet")
    for metric in ("exact_match", "agreement"):
        assert knock.loc[knock["metric"] == metric, "value"].notna().all(), metric
    clean = knock[(knock["metric"] == "answer_logprob") & (knock["condition"] == "clean")]
    assert clean["value"].notna().any()  # 2 steps per 4-slot block: an item whose answer kept a mask is NaN, noted
    assert clean.loc[clean["value"].isna(), "note"].str.startswith("NaN: a gold answer position was not scored").all()
    tf = knock[knock["metric"].str.startswith("tf_")]
    assert len(tf) > 0 and tf["value"].isna().all()
    assert (tf["note"] == not_applicable("bd3lm", {})).all()


def test_report_of_a_features_only_sweep_skips_the_probe_it_cannot_fit(tmp_path):
    # items without answers: none has a scored answer, so the correctness probe is "not fit" with the reason; the
    # report is still built (it used to abort on an empty activation tensor)
    folder = _write(tmp_path / "ckpt", "bd3lm")
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps({"id": i["id"], "prompt": i["question"]}) for i in ITEMS) + "\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", "features", "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "4", "--template", "zoo", "--no-progress"]) == 0
    assert main(["report", str(out)]) == 0
    from mdm_lens.views.fig_probes import sweep_probe_grids

    grids = sweep_probe_grids(pd.read_parquet(out / "features.parquet"), n_boot=10)
    assert grids["correct"]["reason"].str.contains("no item has a scored answer").all()
