"""The report's "KV-cache staleness" section on planted ``cache.parquet`` tables: grids, claims and NaN reasons are
exactly what the planted values give (a claim only where the item bootstrap interval excludes 0)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from mdm_lens.sweep.cache_tables import COLUMNS
from mdm_lens.views import fig_cache, stats, sweep_report

ITEMS = [f"i{k}" for k in range(6)]
STEPS = {0: [1, 2], 1: [4, 5]}  # block: window steps (refresh at 0 and 3): ages 1, 2
LP = {"prefix": [-0.5, -0.4, -0.6, -0.5, -0.45, -0.55], "dual": [-0.1, 0.1, -0.05, 0.05, 0.0, 0.0]}
CHANGED = {"prefix": [0.0] * 6, "dual": [0.25, 0.5, 0.25, 0.25, 0.5, 0.25]}
PATCH = {0: [-0.3] * 6, 1: [-0.1, 0.1, -0.2, 0.2, 0.0, 0.0]}


def _drift(mode, age, layer, item):
    return (2.0 if mode == "dual" else 1.0) * (0.1 * age + 0.01 * layer + 0.001 * item)


def planted() -> pd.DataFrame:
    rows = []
    for k, item in enumerate(ITEMS):
        for mode in ("prefix", "dual"):
            for block, steps in STEPS.items():
                for age, step in enumerate(steps, start=1):
                    base = dict(item_id=item, kv_cache=mode, step=step, block=block, reason="")
                    rows.append(dict(base, layer=-1, metric="logprob_delta", value=LP[mode][k]))
                    for layer in (0, 1):
                        d = _drift(mode, age, layer, k)
                        rows.append(dict(base, layer=layer, metric="k_drift", value=d))
                        rows.append(dict(base, layer=layer, metric="k_cosine", value=1 - d))
                        rows.append(dict(base, layer=layer, metric="received_tv", value=d / 10))
                        if mode == "dual" and item == "i5":
                            rows.append(dict(base, layer=layer, metric="anchor_jaccard", value=np.nan,
                                             reason="no anchors in either forward"))
                        else:
                            rows.append(dict(base, layer=layer, metric="anchor_jaccard", value=0.5))
                        if mode == "prefix":
                            rows.append(dict(base, layer=layer, metric="patch_logprob", value=PATCH[layer][k]))
            rows.append(dict(item_id=item, kv_cache=mode, step=pd.NA, block=pd.NA, layer=pd.NA,
                             metric="answer_changed", value=CHANGED[mode][k], reason=""))
    rows.append(dict(item_id="i6", kv_cache="prefix", step=pd.NA, block=pd.NA, layer=pd.NA, metric="answer_changed",
                     value=np.nan, reason="not run: planted refusal"))
    df = pd.DataFrame(rows, columns=COLUMNS)
    for c in ("step", "block", "layer"):
        df[c] = df[c].astype("Int64")
    df["reason"] = df["reason"].astype("string")
    return df


def _write(root, name, table, items=7):
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"model": {"id": f"planted/{name}", "family": "llada"},
                                                    "items_done": items,
                                                    "arguments": {"probes": ["cache"], "gen_length": 8,
                                                                  "steps": 8}}))
    if table is not None:
        table.to_parquet(root / "cache.parquet")


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    _write(root / "a", "mdm", planted())
    arm = planted().assign(value=np.nan, reason="causal (ARM) model: no KV-cached diffusion loop")
    _write(root / "b", "arm", arm)
    _write(root / "c", "plain", None)
    sweeps, _ = sweep_report.find_sweeps(root)
    secs = sweep_report.sections(sweeps, root / "img")
    (sec,) = [s for s in secs if s.title == "KV-cache staleness"]
    return sec, root


def test_grid_means_over_items_by_layer_and_age():
    t = planted()
    g = fig_cache.staleness_grid(t, "k_drift", "dual")
    assert list(g.index) == [0, 1] and list(g.columns) == [1, 2]
    for layer in (0, 1):
        for age in (1, 2):
            want = np.mean([_drift("dual", age, layer, k) for k in range(6)])
            assert abs(g.loc[layer, age] - want) < 1e-12
    aged = fig_cache.with_age(t)
    assert set(zip(aged.step, aged.age)) == {(1, 1), (2, 2), (4, 1), (5, 2)}
    j = fig_cache.staleness_grid(t, "anchor_jaccard", "dual")  # i5's NaN rows are skipped, never 0
    assert (j == 0.5).all().all()


def _claim(sec, what):
    row = sec.claims[sec.claims.comparison == what]
    assert len(row) == 1, what
    return row.iloc[0]


def test_claims_follow_the_intervals(section):
    sec, _ = section
    lp = _claim(sec, "mdm prefix: log-prob cached − fresh")
    assert lp["verdict"] == "negative" and lp["Δ"] == "-0.500 nats" and lp["n items"] == "6"
    assert "mdm, prefix cache: the run's final tokens are less likely under the stale cache than fresh" in sec.finding
    assert _claim(sec, "mdm dual: log-prob cached − fresh")["verdict"] == "tie" and lp["level"] == "95%"
    assert "mdm, dual cache: no measured log-prob difference between stale and fresh keys (tie" in sec.finding
    assert "dual cache: the run's final tokens are" not in sec.finding
    # a share that is 0 for every item is a point interval at 0: a tie, never a claim
    ch = _claim(sec, "mdm prefix: share of generated tokens changed")
    assert ch["verdict"] == "tie" and ch["CI"] == "+0.000 to +0.000" and ch["excluded"] == 1
    dual = _claim(sec, "mdm dual: share of generated tokens changed")
    assert dual["verdict"] == "positive" and dual["Δ"] == stats.fmt(np.mean(CHANGED["dual"]), 3)
    assert "mdm, dual cache: the decoded tokens differ from the uncached decode" in sec.finding
    kd = _claim(sec, "mdm: dual − prefix K drift")
    want = np.mean([np.mean([_drift("prefix", a, l, k) for a in (1, 2) for l in (0, 1)]) for k in range(6)])
    assert kd["verdict"] == "positive" and kd["Δ"] == stats.fmt(want, 3)
    assert _claim(sec, "mdm: dual − prefix log-prob change")["verdict"] == "positive"


def test_per_layer_patching_uses_a_family_wise_interval(section):
    sec, _ = section
    l0 = _claim(sec, "mdm prefix: layer 0 alone stale, log-prob − fresh")
    assert l0["verdict"] == "negative" and l0["Δ"] == "-0.300 nats" and l0["level"] == "98%"  # Claims' rounding
    assert "Per-layer patching levels (1 − 0.05 / layers; the sentences print them rounded): mdm: 97.5%" in sec.text
    assert "staleness at layer 0 alone lowers the log-prob" in sec.finding
    l1 = _claim(sec, "mdm prefix: layer 1 alone stale, log-prob − fresh")
    assert l1["verdict"] == "tie" and "staleness at layer 1 alone has no measured effect (tie" in sec.finding
    iv = stats.bootstrap_mean(pd.Series(PATCH[1], index=ITEMS), level=0.975)
    assert l1["CI"] == f"{stats.fmt(iv.low, 3)} to {stats.fmt(iv.high, 3)}"
    assert not sec.claims.comparison.str.contains("dual: layer").any()  # dual has no patch rows


def test_nan_rows_are_reported_with_their_reason_and_absent_sweeps_named(section):
    sec, root = section
    assert "- mdm, dual, anchor_jaccard: 8 NaN row(s) in 1 item(s) — no anchors in either forward" in sec.text
    assert "- mdm, prefix, answer_changed: 1 NaN row(s) in 1 item(s) — not run: planted refusal" in sec.text
    row = sec.table[(sec.table.kv_cache == "dual") & (sec.table.metric == "anchor_jaccard")].iloc[0]
    assert row["mean over items"] == 0.5 and row["items"] == 5 and row["NaN rows"] == 8
    absent = "\n".join(sec.absent)
    assert "arm: every cache value is NaN (causal (ARM) model: no KV-cached diffusion loop)" in absent
    assert "plain: no cache table" in absent
    names = {p.name for p in (root / "img").iterdir()}
    assert names == {"cache_maps_mdm.png", "cache_logprob_mdm.png"}


def test_the_report_html_has_the_section(section, tmp_path):
    _, root = section
    html = (sweep_report.report(root, out=tmp_path / "rep")).read_text()
    assert "KV-cache staleness" in html and "cache_maps_mdm.png" in html


def test_a_table_that_is_not_a_cache_table_is_refused():
    with pytest.raises(Exception, match="lacks the column"):
        fig_cache.with_age(pd.DataFrame({"item_id": ["a"]}))
