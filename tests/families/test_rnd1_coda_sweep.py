"""`mdm-lens sweep` (every probe) and `mdm-lens report` on the RND1 and CoDA tiny checkpoints (hub layouts, a
character-level tokenizer so the zoo items render), and the router probe on RND1's MoE layers."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.cli import main
from mdm_lens.loading.rnd1 import ReferenceConfigWarning
from rnd1_coda_checkpoints import write_coda, write_rnd1
from test_family_sweep import ITEMS, PROBES, _char_tokenizer

WRITERS = {"rnd1": write_rnd1, "coda": write_coda}


@pytest.mark.parametrize("family", ["rnd1", "coda"])
def test_sweep_and_report_run_on_the_family(tmp_path, family):
    folder = WRITERS[family](tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceConfigWarning)
        assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", PROBES + ",atp", "--out", str(out),
                     "--limit", "2", "--gen-length", "4", "--steps", "2", "--template", "zoo", "--no-progress",
                     "--batch-size", "1"]) == 0  # RND1 decodes one prompt at a time; CoDA refuses padding
        assert main(["report", str(out)]) == 0
    for probe in (PROBES + ",atp").split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == {"a", "b"}, probe
    assert (out / "report").is_dir() and any((out / "report").iterdir())
    assert pd.read_parquet(out / "atp.parquet")["value"].notna().all()  # plain canvas forwards: every step defined


def test_router_probe_on_rnd1(tmp_path):
    from mdm_lens.probes import router_stats

    folder = write_rnd1(tmp_path / "rnd1")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceConfigWarning)
        model = HookedMDM.from_pretrained(folder)
    out = model.generate(torch.tensor([[5, 17, 3, 42]]), steps=3, gen_length=6, greedy=True)
    table = router_stats(model, out, steps=[0, 1]).table
    assert len(table) > 0 and set(table["layer"]) == {0, 1}
    assert set(table["expert"].dropna()) <= set(range(8))
    for layer in (0, 1):  # every top-k slot of a class lands on some expert: its load shares sum to 1
        loads = table[(table["metric"] == "load") & (table["step"] == 0) & (table["layer"] == layer)
                      & (table["class"] == "canvas")]
        assert abs(float(loads["value"].sum()) - 1.0) < 1e-6
    entropy = table[table["metric"] == "router_entropy"]["value"]
    assert ((entropy > 0) & (entropy < torch.log(torch.tensor(8.0)).item())).all()  # a softmax over 8 experts
