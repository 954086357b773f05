"""The sweep's ``lens`` probe: its rows equal the lens of each item run alone (to float rounding: the batched and
single-item forwards may pick different BLAS kernels); ARM rows are NaN with a note."""

import numpy as np
import pandas as pd
import pytest
import torch

from mdm_lens import sweep
from mdm_lens.lens import answer_emergence, lens_trace
from mdm_lens.sweep import lens_tables
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    return path, jsonl.export(path, 4, seed=34)


@pytest.fixture(scope="module")
def folder(mdm, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    tables = sweep.run(mdm, data[0], "lens", out, batch_size=4, progress=False)
    assert (out / "lens.parquet").is_file()
    return out, tables["lens"]


@pytest.fixture(scope="module")
def table(folder):
    return folder[1]


def test_rows_equal_the_lens_of_the_item_alone(mdm, data, table):
    assert list(table.columns) == lens_tables.COLUMNS
    for c in ("step", "layer", "answer_position"):
        assert str(table[c].dtype) == "Int64"
    g = mdm.cfg.extra["gen_length"]
    L = mdm.cfg.n_layers
    assert table.item_id.nunique() == 4
    per_item = len(lens_tables.STEP_METRICS) * g * L + len(lens_tables.EMERGENCE_METRICS) * L * g
    assert (table.groupby("item_id").size() == per_item).all()
    for k, qa in enumerate(data[1]):
        rows = table[table.item_id == f"zoo-34-{k:05d}"]
        assert len(rows) == per_item
        ids = torch.tensor(ZT.encode(qa.prompt))[None]
        out = mdm.generate(ids, gen_length=g, steps=g)
        trace = lens_trace(mdm, out)
        acc = trace.accuracy("masked")[:, :, 0]
        step_rows = rows[rows.metric == "acc_masked"].sort_values(["step", "layer"])
        np.testing.assert_allclose(step_rows.value.to_numpy(), acc.reshape(-1).numpy(), rtol=0, atol=1e-12)
        em = answer_emergence(trace)
        got = rows[rows.metric == "emergence_step"].sort_values(["layer", "answer_position"])
        want = em.sort_values(["layer", "position"]).emergence_step.astype("Float64").to_numpy(float, na_value=np.nan)
        np.testing.assert_array_equal(got.value.to_numpy(), want)
        assert got.note.isna().tolist() == list(~np.isnan(want))
        # the answer flag: positions before the first <eos>
        first_eos = next((p for p, t in enumerate(out.generated[0].tolist()) if t == mdm.cfg.eos_token_id), g)
        flags = got[got.layer == 0].answer.tolist()
        assert flags == [p < first_eos for p in range(g)]


def test_nan_rows_carry_notes(table):
    nan = table[table.value.isna()]
    assert nan.note.notna().all()
    # the last step of a run with one commit per step has one masked position left: n_masked = 1 there
    last = table[(table.metric == "n_masked") & (table.step == table.step.max())]
    assert (last.value == 1).all()


def test_arm_rows_are_nan_with_a_note(arm, data, tmp_path):
    t = sweep.run(arm, data[0], "lens", tmp_path / "arm", batch_size=4, progress=False)["lens"]
    assert len(t) == 4 and t.value.isna().all() and t.note.str.contains("causal").all()
    assert isinstance(t, pd.DataFrame)


def test_report_section_and_grid(folder, tmp_path):
    from mdm_lens.views import sweep_report
    from mdm_lens.views.fig_lens import lens_grid, lens_section

    root, t = folder
    grid = lens_grid(t)
    one = t[(t.metric == "acc_masked") & (t.layer == 2) & (t.step == 1)].value
    assert grid.loc[2, 1] == pytest.approx(one.mean()) and grid.shape == (4, 4)
    sec = lens_section(sweep_report.load_sweeps(root), tmp_path)
    assert sec.title == "Lenses over denoising steps" and (tmp_path / "lens_tiny-mdm.png").is_file()
    emerged = t[(t.metric == "emergence_step") & (t.layer == 3) & t.answer.fillna(False).astype(bool)]
    row = sec.table[sec.table.layer == 3].iloc[0]
    assert row["answer tokens"] == len(emerged)
    assert row["emerged by commit"] == pytest.approx(emerged.value.notna().mean(), abs=1e-3)
    html = sweep_report.report(root, tmp_path / "report")
    assert "Lenses over denoising steps" in html.read_text()
