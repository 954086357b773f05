"""The sweep's ``features`` probe and the report's linear-probe section: rows equal the masked-mean residual of
each item run alone (to 1e-6: the batched and single-item forwards may pick other BLAS kernels), targets equal
the accuracy probe's, the budget refuses before any model call, and the section claims only what a CI supports."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from mdm_lens import steps, sweep
from mdm_lens.errors import MemoryBudgetError
from mdm_lens.lens import features_from_cache
from mdm_lens.sweep import feature_tables as FT
from mdm_lens.views import fig_probes
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    return path, jsonl.export(path, 4, seed=34)


@pytest.fixture(scope="module")
def folder(mdm, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    tables = sweep.run(mdm, data[0], "accuracy,features", out, batch_size=4, progress=False)
    assert (out / "features.parquet").is_file()
    return out, tables


def test_rows_equal_the_cached_residuals_of_the_item_alone(mdm, data, folder):
    t = folder[1]["features"]
    # the sweep adds every table that has gold_index the item's whole gold set (tests/test_sweep_data.py)
    expected = FT.COLUMNS[:FT.COLUMNS.index("gold_index") + 1] + ["gold_indices"] + \
        FT.COLUMNS[FT.COLUMNS.index("gold_index") + 1:]
    assert list(t.columns) == expected
    for c in ("step", "layer", "n_masked", "gold_index"):
        assert str(t[c].dtype) == "Int64"
    g, L, d = mdm.cfg.extra["gen_length"], mdm.cfg.n_layers, mdm.cfg.d_model
    assert t.note.isna().all()                      # one commit per step: every step has a masked position
    for k, qa in enumerate(data[1]):
        rows = t[t.item_id == f"zoo-34-{k:05d}"]
        assert len(rows) == g * L
        assert rows[["step", "layer"]].to_numpy().tolist() == [[s, l] for s in range(g) for l in range(L)]
        ids = ZT.encode(qa.prompt)
        out = mdm.generate(torch.tensor(ids)[None], gen_length=g, steps=g, cache="blocks.*.hook_resid_post" @ steps())
        masked = out.trajectory.x_steps == mdm.cfg.mask_token_id            # [step, 1, pos]
        masked[:, :, :out.prompt_length] = False                            # the canvas only
        want = features_from_cache(out.cache, positions=masked).acts[:, :, 0]  # [layer, step, d]
        got = np.stack(rows.feature.to_numpy()).reshape(g, L, d).transpose(1, 0, 2)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
        assert rows.n_masked.tolist() == np.repeat(masked.sum(-1)[:, 0].numpy(), L).tolist()
        assert rows.n_masked.tolist() == [g - s for s in range(g) for _ in range(L)]


def test_targets_equal_the_accuracy_probe(data, folder):
    t, acc = folder[1]["features"], folder[1]["accuracy"]
    wc = acc[acc.condition == "with_context"].pivot(index="item_id", columns="metric", values="value")
    per_item = t.groupby("item_id").agg(acc=("acc", "first"), em=("em", "first"), gold=("gold_index", "first"),
                                        n_acc=("acc", "nunique"))
    assert (per_item.n_acc == 1).all()
    np.testing.assert_array_equal(per_item.acc.to_numpy(), wc.loc[per_item.index, "acc"].to_numpy())
    np.testing.assert_array_equal(per_item.em.to_numpy(), wc.loc[per_item.index, "em"].to_numpy())
    assert per_item.gold.tolist() == [qa.gold_index for qa in data[1]]
    assert t.target_note.isna().all()


def test_undefined_targets_are_na_with_a_reason(mdm, data, tmp_path):
    lines = [json.loads(x) for x in data[0].read_text().splitlines()[:2]]
    del lines[0]["answers"]
    del lines[1]["gold_index"]
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t = sweep.run(mdm, path, "features", tmp_path / "out", batch_size=2, progress=False)["features"]
    a, b = t[t.item_id == lines[0]["id"]], t[t.item_id == lines[1]["id"]]
    assert a.acc.isna().all() and a.em.isna().all() and a.gold_index.notna().all()
    assert (a.target_note == "acc/em: the item has no gold answer").all()
    assert b.acc.notna().all() and b.gold_index.isna().all()
    assert (b.target_note == "gold_index: no gold passage is marked").all()


def test_arm_rows_are_nan_with_a_note(arm, data, tmp_path):
    t = sweep.run(arm, data[0], "accuracy,features", tmp_path / "arm", batch_size=4, progress=False)
    f = t["features"]
    assert len(f) == 4 and f.step.isna().all() and f.note.str.contains("causal").all()
    assert all(np.isnan(v).all() and len(v) == arm.cfg.d_model for v in f.feature)
    wc = t["accuracy"].query("condition == 'with_context' and metric == 'acc'").set_index("item_id").value
    np.testing.assert_array_equal(f.set_index("item_id").acc.to_numpy(), wc.loc[f.item_id].to_numpy())


def test_budget_is_refused_before_any_model_call(mdm, data, tmp_path, monkeypatch):
    need = 4 * 4 * mdm.cfg.n_layers * mdm.cfg.d_model * 4            # items × steps × layers × d_model × fp32
    assert FT.estimate_bytes(mdm, 4, 4) == need
    assert FT.check_budget(mdm, 4, 4, budget=need) == need
    with pytest.raises(MemoryBudgetError, match="export-activations"):
        FT.check_budget(mdm, 4, 4, budget=need - 1)

    def boom(*a, **k):
        raise AssertionError("the model ran before the budget check")

    monkeypatch.setattr(mdm, "generate", boom)
    monkeypatch.setenv(FT.BUDGET_ENV, str((need - 1) / 2 ** 20))
    with pytest.raises(MemoryBudgetError, match=r"4 items × 4 steps × 4 layers × d_model 128.*--steps"):
        sweep.run(mdm, data[0], "features", tmp_path / "out", batch_size=4, progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv(FT.BUDGET_ENV, "lots")
    with pytest.raises(Exception, match=FT.BUDGET_ENV):
        FT.budget_bytes()


# --- the report section ----------------------------------------------------------------------------

class _Sweep:
    def __init__(self, label, table):
        self.label, self._t = label, table

    def table(self, name):
        return self._t if name == "features" else None


def _planted(n_items=40, layers=3, n_steps=4, d=6, seed=0, plant=True):
    """Random features; with ``plant`` feature 0 at (layer 1, step 2) is the label (AUC 1 there) and feature 1
    at layer 2 is the step (R² ≈ 1 there)."""
    rng = np.random.default_rng(seed)
    label = rng.permutation(np.arange(n_items) % 2)
    rows = []
    for i in range(n_items):
        for s in range(n_steps):
            for l in range(layers):
                v = rng.normal(size=d).astype(np.float32)
                if plant and (l, s) == (1, 2):
                    v[0] = 3.0 * label[i] + 0.1 * v[0]
                if plant and l == 2:
                    v[1] = s + 0.01 * v[1]
                rows.append(dict(item_id=f"i{i}", step=s, layer=l, feature=v, acc=float(label[i])))
    return pd.DataFrame(rows)


def test_section_names_the_planted_cell(tmp_path):
    sec = fig_probes.probes_section([_Sweep("planted", _planted())], tmp_path)
    assert "correctness is linearly decodable above chance (AUC CI above 0.5) at layer 1, step 2: AUC 1.00, " \
           "CI [1.00, 1.00]" in sec.finding
    assert "(1 of 12 cells exclude chance)" in sec.finding
    assert "the latent step is linearly decodable above chance (R² CI above 0) at layer 2" in sec.finding
    assert "(1 of 3 cells" in sec.finding
    path, caption = sec.images[0]
    assert path.is_file() and "n = 40 items" in caption and "95% family-wise" in caption
    row = sec.table[(sec.table.layer == 1) & (sec.table.step == 2)].iloc[0]
    assert row["value"] == 1.0 and row["CI low"] == 1.0 and row["test items"] == 10


def test_null_section_makes_no_claim(tmp_path):
    sec = fig_probes.probes_section([_Sweep("null", _planted(plant=False, seed=1))], tmp_path)
    assert "decodable" not in sec.finding
    assert "null: no cell's CI excludes chance (AUC 0.5) for answer correctness" in sec.finding
    assert "null: no cell's CI excludes chance (R² 0) for the latent step" in sec.finding
    grids = fig_probes.sweep_probe_grids(_planted(plant=False, seed=1))
    auc = grids["correct"][grids["correct"].metric == "auc"]
    assert auc.value.notna().all() and not (auc.ci_low > 0.5).any()
    assert grids["correct"].attrs["ci"] == pytest.approx(1 - 0.05 / 12)


def test_too_few_items_show_the_reasons_and_no_claim(tmp_path):
    t = _planted(n_items=6)
    t["acc"] = t.item_id.map({"i0": 1.0}).fillna(0.0)                                # one correct item
    t.loc[t.item_id == "i5", "acc"] = np.nan                                          # unscored: not in (a)
    t.at[t.index[t.item_id == "i4"][0], "feature"] = np.full(6, np.nan, np.float32)   # incomplete: left out
    feats, targets = fig_probes.sweep_features(t)
    assert feats.acts.shape[:3] == (3, 4, 5) and targets.item_id.tolist() == ["i0", "i1", "i2", "i3", "i5"]
    sec = fig_probes.probes_section([_Sweep("few", t)], tmp_path)
    auc = sec.table[sec.table.metric == "auc"]
    assert len(auc) == 12 and auc.value.isna().all()
    assert auc.reason.str.contains("the test split lacks class(es) [1]", regex=False).all()
    assert auc["test items"].eq(1).all() and auc["train items"].eq(3).all()
    assert "few: no claim on answer correctness, the AUC is undefined in every cell (the test split lacks" \
        in sec.finding
    assert "n = 4 items with a correctness label (1 correct" in sec.images[0][1]
    assert "(1 without a complete feature grid left out)" in sec.images[0][1]
    six = fig_probes.probes_section([_Sweep("six", _planted(n_items=6))], tmp_path)     # planted, 2 test items
    assert "decodable" not in six.finding
    assert "six: no claim on answer correctness, the cells were scored on 2 test items (a claim needs 10)" \
        in six.finding
    two = fig_probes.sweep_probe_grids(_planted(n_items=2))["correct"]                 # no test item at all
    assert len(two) == 1 and np.isnan(two.value[0]) and two.reason[0].startswith("not fit: a stratified split")


def test_report_renders_the_section_from_a_sweep(folder, tmp_path):
    from mdm_lens.views import sweep_report

    html = sweep_report.report(folder[0], tmp_path / "report").read_text()
    assert "Linear probes over layer × step" in html and "probes_tiny-mdm.png" in html
