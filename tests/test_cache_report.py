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
                    rows.append(dict(base, layer=pd.NA, metric="logprob_delta", value=LP[mode][k]))
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
    # its manifest lists the cache probe but the folder has no table: a partial copy, said so
    assert "plain: cache.parquet is missing from its sweep folder(s) although the manifest lists the cache probe" in absent
    names = {p.name for p in (root / "img").iterdir()}
    assert names == {"cache_maps_mdm.png", "cache_logprob_mdm.png"}


def test_the_report_html_has_the_section(section, tmp_path):
    _, root = section
    html = (sweep_report.report(root, out=tmp_path / "rep")).read_text()
    assert "KV-cache staleness" in html and "cache_maps_mdm.png" in html


def test_a_table_that_is_not_a_cache_table_is_refused():
    with pytest.raises(Exception, match="lacks the column"):
        fig_cache.with_age(pd.DataFrame({"item_id": ["a"]}))


# --- uneven planted table: 3 items with unequal rows per cell, so the mean over items of item means, the pooled
# mean over rows and the median over items all differ; the two modes number their steps differently (a threshold
# run commits at its own rate per mode), and the rows are given in reverse order.
U_ITEMS = ["a", "b", "c"]
U_STEPS = {"prefix": {"a": {0: [1, 2], 1: [4, 5, 6]}, "b": {0: [1, 2], 1: [4, 5]}, "c": {0: [1, 2]}},
           "dual": {"a": {0: [1], 1: [3, 4]}, "b": {0: [1], 1: [3]}, "c": {0: [1, 2, 3]}}}
U_BASE = {"a": 0.0, "b": 0.0, "c": 3.0}
U_LP = {"prefix": {"a": -0.2, "b": -0.4, "c": -0.9}, "dual": {"a": 0.1, "b": -0.1, "c": 0.3}}
U_PATCH = {"prefix": {"a": -0.3, "b": -0.5, "c": -0.2}, "dual": {"a": 0.2, "b": 0.1, "c": 0.4}}
U_NAN_JACCARD = {("prefix", "b", 1, 0): pd.NA, ("prefix", "c", 2, 1): ""}  # (mode, item, step, layer): reason


def _u_drift(mode, item, block, age, layer):
    return (2.0 if mode == "dual" else 1.0) * (U_BASE[item] + 0.5 * block + 0.1 * age + 0.01 * layer)


def uneven_rows() -> list[dict]:
    """The planted rows in step order, each with its true cache ``age`` (steps since the block's refresh)."""
    rows = []
    for mode in ("prefix", "dual"):
        for item in U_ITEMS:
            for block, steps in U_STEPS[mode][item].items():
                for age, step in enumerate(steps, start=1):
                    base = dict(item_id=item, kv_cache=mode, step=step, block=block, reason="", age=age)
                    rows.append(dict(base, layer=-1, metric="logprob_delta", value=U_LP[mode][item] - 0.1 * block))
                    for layer in (0, 1):
                        d = _u_drift(mode, item, block, age, layer)
                        rows.append(dict(base, layer=layer, metric="k_drift", value=d))
                        rows.append(dict(base, layer=layer, metric="v_drift", value=d + 0.7))
                        rows.append(dict(base, layer=layer, metric="received_tv", value=d / 10))
                        rows.append(dict(base, layer=layer, metric="patch_logprob", value=U_PATCH[mode][item]))
                        if (mode, item, step, layer) in U_NAN_JACCARD:
                            rows.append(dict(base, layer=layer, metric="anchor_jaccard", value=np.nan,
                                             reason=U_NAN_JACCARD[mode, item, step, layer]))
                        else:
                            rows.append(dict(base, layer=layer, metric="anchor_jaccard", value=0.5))
    return rows


def _table(rows) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=COLUMNS)
    for c in ("step", "block", "layer"):
        df[c] = df[c].astype("Int64")
    df["value"] = df["value"].astype(float)
    df["reason"] = df["reason"].astype("string")
    return df


def uneven() -> pd.DataFrame:
    return _table(uneven_rows()[::-1])


def _item_mean(rows, **match):
    """Reference: the mean over items of each item's mean over the matching rows (finite values only)."""
    per = {}
    for r in rows:
        if all(r[k] == v for k, v in match.items()) and not np.isnan(r["value"]):
            per.setdefault(r["item_id"], []).append(r["value"])
    return float(np.mean([np.mean(v) for v in per.values()]))


def test_uneven_reference_separates_item_mean_from_pooled_and_median():
    # the planted cell the grid, curve and summary tests lean on: if these coincide the tests below prove nothing
    rows = [r for r in uneven_rows() if r["kv_cache"] == "prefix" and r["metric"] == "k_drift" and r["layer"] == 0
            and r["age"] == 1]
    per = {i: np.mean([r["value"] for r in rows if r["item_id"] == i]) for i in U_ITEMS}
    assert [len([r for r in rows if r["item_id"] == i]) for i in U_ITEMS] == [2, 2, 1]
    item_mean, pooled, median = np.mean(list(per.values())), np.mean([r["value"] for r in rows]), np.median(
        list(per.values()))
    assert abs(item_mean - 3.8 / 3) < 1e-12 and abs(pooled - 0.9) < 1e-12 and abs(median - 0.35) < 1e-12


def test_age_is_per_mode_from_the_blocks_smallest_step_whatever_the_row_order():
    # rows reversed (latest step first) and the dual cache's block 1 refreshes at step 2, the prefix cache's at 3
    rows = uneven_rows()[::-1]
    aged = fig_cache.with_age(_table(rows))
    assert list(aged["age"]) == [r["age"] for r in rows]
    a1 = aged[(aged.item_id == "a") & (aged.block == 1) & (aged.metric == "logprob_delta")]
    assert sorted(zip(a1.kv_cache, a1.step, a1.age)) == [("dual", 3, 1), ("dual", 4, 2), ("prefix", 4, 1),
                                                         ("prefix", 5, 2), ("prefix", 6, 3)]
    shuffled = _table([dict(item_id="x", kv_cache="prefix", step=s, block=0, layer=0, metric="k_drift", value=1.0,
                            reason="") for s in (3, 1, 2)])
    assert list(fig_cache.with_age(shuffled)["age"]) == [3, 1, 2]


def test_grid_is_the_mean_over_items_of_item_means_with_unequal_rows():
    t, rows = uneven(), uneven_rows()
    g = fig_cache.staleness_grid(t, "k_drift", "prefix")
    assert list(g.index) == [0, 1] and list(g.columns) == [1, 2, 3]
    # layer 0, age 1: a (0.1, 0.6) -> 0.35, b (0.1, 0.6) -> 0.35, c (3.1) -> 3.1; pooled would be 0.9, median 0.35
    assert abs(g.loc[0, 1] - (0.35 + 0.35 + 3.1) / 3) < 1e-12
    assert abs(g.loc[1, 3] - 0.81) < 1e-12  # age 3 only in item a's block 1: 0.5 + 0.3 + 0.01
    for mode in ("prefix", "dual"):
        g = fig_cache.staleness_grid(t, "k_drift", mode)
        for layer in g.index:
            for age in g.columns:
                want = _item_mean(rows, kv_cache=mode, metric="k_drift", layer=layer, age=age)
                assert abs(g.loc[layer, age] - want) < 1e-12, (mode, layer, age)
    three = _table([dict(item_id=i, kv_cache="prefix", step=1, block=0, layer=0, metric="k_drift", value=v,
                         reason="") for i, v in (("x", 0.0), ("y", 0.0), ("z", 3.0))])
    assert fig_cache.staleness_grid(three, "k_drift", "prefix").loc[0, 1] == 1.0  # mean, not the median 0


def test_heatmaps_put_layer_0_at_the_bottom_and_share_a_colour_scale_across_modes():
    t = uneven()
    grids = {m: {"k_drift": fig_cache.staleness_grid(t, "k_drift", m)} for m in ("prefix", "dual")}
    fig = fig_cache.staleness_heatmaps(grids)
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 2
    vals = np.concatenate([grids[m]["k_drift"].to_numpy(float).ravel() for m in grids])
    lo, hi = float(np.nanmin(vals)), float(np.nanmax(vals))
    assert lo == grids["prefix"]["k_drift"].min().min() and hi == grids["dual"]["k_drift"].max().max()
    for ax, mode in zip(axes, ("prefix", "dual")):
        im = ax.images[0]
        assert im.origin == "lower" and ax.get_ylim() == (-0.5, 1.5)
        assert im.get_clim() == (lo, hi)
        np.testing.assert_array_equal(np.ma.filled(im.get_array(), np.nan), grids[mode]["k_drift"].to_numpy(float))


def test_logprob_curve_and_patch_bars_are_means_over_items_per_mode():
    rows = uneven_rows()
    fig = fig_cache.logprob_figure(uneven())
    left, right = fig.axes[0], fig.axes[1]
    for line, mode in zip(left.lines[:2], ("prefix", "dual")):
        assert line.get_label() == f"{mode} cache"
        assert list(line.get_xdata()) == [1, 2, 3]
        want = [_item_mean(rows, kv_cache=mode, metric="logprob_delta", age=a) for a in (1, 2, 3)]
        np.testing.assert_allclose(line.get_ydata(), want, rtol=0, atol=1e-12)
    # prefix, age 1: a (-0.2, -0.3), b (-0.4, -0.5), c (-0.9): (-0.25 - 0.45 - 0.9) / 3, not the pooled -0.46
    assert abs(left.lines[0].get_ydata()[0] + 1.6 / 3) < 1e-12
    bars = [p.get_height() for p in right.patches]
    np.testing.assert_allclose(bars, [-1.0 / 3] * 2 + [0.7 / 3] * 2, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def uneven_sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    _write(root / "u", "uneven", uneven(), items=3)
    _write(root / "arm", "armu", uneven().assign(value=np.nan, reason="causal (ARM) model"), items=3)
    refused = [r for r in uneven_rows() if r["kv_cache"] == "prefix" and r["metric"] != "patch_logprob"]
    refused += [dict(item_id=i, kv_cache="prefix", step=pd.NA, block=pd.NA, layer=pd.NA, metric="answer_changed",
                     value=v, reason="") for i, v in zip(U_ITEMS, (0.25, 0.5, 0.0))]
    refused += [dict(item_id=i, kv_cache="dual", step=pd.NA, block=pd.NA, layer=pd.NA, metric="answer_changed",
                     value=np.nan, reason="not run: refused") for i in U_ITEMS]
    _write(root / "r", "refused", _table(refused), items=3)
    sweeps, _ = sweep_report.find_sweeps(root)
    (root / "img").mkdir()
    return {s.label: s for s in sweeps}, root / "img"


def test_uneven_section_claims_summary_and_nan_reasons(uneven_sweeps):
    sweeps, img = uneven_sweeps
    assert fig_cache.cache_section([sweeps["armu"]], img) is None  # every value NaN: no section
    sec = fig_cache.cache_section([sweeps["uneven"], sweeps["armu"]], img)
    rows = uneven_rows()
    assert set(sec.table.model) == {"uneven"} and not sec.claims.comparison.str.contains("armu").any()
    per_mode = ["log-prob cached − fresh", "mean K drift", "mean received-attention TV", "mean anchor Jaccard",
                "layer 0 alone stale, log-prob − fresh", "layer 1 alone stale, log-prob − fresh"]
    # no answer_changed rows (probes.cache_effect's own table): no share claim; prefix before dual
    assert list(sec.claims.comparison) == (
        [f"uneven prefix: {w}" for w in per_mode] + [f"uneven dual: {w}" for w in per_mode]
        + ["uneven: dual − prefix K drift", "uneven: dual − prefix received-attention TV",
           "uneven: dual − prefix log-prob change"])
    c = sec.claims.set_index("comparison")
    for mode in ("prefix", "dual"):
        kd = _item_mean(rows, kv_cache=mode, metric="k_drift")
        assert c.loc[f"uneven {mode}: mean K drift", "Δ"] == stats.fmt(kd, 3)  # v_drift is k_drift + 0.7
        lp = _item_mean(rows, kv_cache=mode, metric="logprob_delta")
        assert c.loc[f"uneven {mode}: log-prob cached − fresh", "Δ"] == f"{stats.fmt(lp, 3)} nats"
    for layer in (0, 1):
        p = c.loc[f"uneven prefix: layer {layer} alone stale, log-prob − fresh"]
        d = c.loc[f"uneven dual: layer {layer} alone stale, log-prob − fresh"]
        assert (p["Δ"], p["verdict"], d["Δ"], d["verdict"]) == ("-0.333 nats", "negative", "+0.233 nats", "positive")
    tb = sec.table
    assert list(tb.kv_cache) == ["prefix"] * 6 + ["dual"] * 6
    lp = tb[(tb.kv_cache == "prefix") & (tb.metric == "logprob_delta")].iloc[0]
    # item means -0.26 (a: 2 rows -0.2, 3 rows -0.3), -0.45 (b: 2 + 2), -0.9 (c: 2); pooled over rows: -0.4455
    want = (-0.26 - 0.45 - 0.9) / 3
    assert abs(want - _item_mean(rows, kv_cache="prefix", metric="logprob_delta")) < 1e-12
    assert lp["mean over items"] == round(want, 4) and lp["items"] == 3 and lp["NaN rows"] == 0
    # one NaN row has reason <NA>, one ''
    n = fig_cache.nan_reasons(uneven())
    assert n.to_dict("records") == [dict(kv_cache="prefix", metric="anchor_jaccard", reason="", rows=2, items=2)]
    assert "- uneven, prefix, anchor_jaccard: 2 NaN row(s) in 2 item(s) — no reason recorded" in sec.text
    assert "no per-layer stale patching" not in sec.text


def test_a_mode_refused_for_every_item_gets_no_claims_and_absent_patching_is_named(uneven_sweeps):
    sweeps, img = uneven_sweeps
    sec = fig_cache.cache_section([sweeps["refused"]], img)
    assert list(sec.claims.comparison) == [
        "refused prefix: log-prob cached − fresh", "refused prefix: share of generated tokens changed",
        "refused prefix: mean K drift", "refused prefix: mean received-attention TV",
        "refused prefix: mean anchor Jaccard"]
    assert _claim(sec, "refused prefix: share of generated tokens changed")["Δ"] == stats.fmt(0.25, 3)
    d = sec.table[sec.table.kv_cache == "dual"]
    assert list(d.metric) == ["answer_changed"] and np.isnan(d.iloc[0]["mean over items"])
    assert (d.iloc[0]["items"], d.iloc[0]["NaN rows"]) == (0, 3)
    assert "- refused, dual, answer_changed: 3 NaN row(s) in 3 item(s) — not run: refused" in sec.text
    assert ("- refused: no per-layer stale patching (`patch_logprob`) rows: the sweep's cache probe runs "
            "`cache_effect(..., patch=False)`") in sec.text
