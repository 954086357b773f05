"""The sweep report claims only what its tables show: planted sweep folders whose comparisons are a clear win,
a tie, or undefined; every finding sentence parsed back from the HTML and matched to its claims table; the
schema (dtypes, README) from one source; no crash without gold indices; no import cycle in sweep/views."""

from __future__ import annotations

import ast
import html as H
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sweep import schema, summary
from mdm_lens.views import stats
from mdm_lens.views import sweep_report as SR

ROOT = Path(__file__).resolve().parents[1]


# --- stats ------------------------------------------------------------------------------------------

def test_bootstrap_is_over_items_seeded_and_exact_on_planted_cases():
    rows = pd.DataFrame({"item_id": ["a"] * 10 + ["b"], "value": [1.0] * 10 + [0.0]})
    assert stats.per_item(rows).to_dict() == {"a": 1.0, "b": 0.0}        # one value per item, not per row
    iv = stats.bootstrap_mean(stats.per_item(rows))
    assert iv.estimate == 0.5 and iv.n == 2 and (iv.low, iv.high) == (0.0, 1.0)
    x = np.random.default_rng(1).normal(size=40)
    assert stats.bootstrap_mean(x) == stats.bootstrap_mean(x)            # seeded
    assert stats.bootstrap_mean(x, seed=1) != stats.bootstrap_mean(x, seed=2)
    const = stats.bootstrap_mean([2.0, 2.0, np.nan])
    assert (const.estimate, const.low, const.high, const.n, const.n_excluded) == (2.0, 2.0, 2.0, 2, 1)
    assert const.verdict == "positive"
    assert stats.bootstrap_mean([-1.0, 1.0, -1.0, 1.0]).verdict == "tie"
    assert stats.bootstrap_mean([3.0]).verdict == "undefined" and stats.bootstrap_mean([]).verdict == "undefined"
    a = pd.Series([1.0, 2.0, 3.0], index=["x", "y", "z"])
    d = stats.difference(a, a - 1.0)                                      # same items: paired, every Δ = 1
    assert (d.estimate, d.low, d.high, d.n, d.n_other) == (1.0, 1.0, 1.0, 3, None)
    u = stats.difference(a, pd.Series([0.0, 0.0], index=["p", "q"]))    # other items: two samples
    assert u.estimate == 2.0 and (u.n, u.n_other) == (3, 2)
    with pytest.raises(ArgumentError, match="n_boot"):
        stats.bootstrap_mean([1.0, 2.0], n_boot=10)
    with pytest.raises(ArgumentError, match="value"):
        stats.per_item(rows, value="nope")


def test_compare_states_a_claim_only_off_zero():
    pos = stats.Interval(0.3, 0.1, 0.5, 10)
    assert stats.compare(pos, "A wins", "B wins", "A ties B") == "A wins: Δ = +0.30 (95% CI +0.10 to +0.50; n = 10 items)"
    neg = stats.Interval(-0.3, -0.5, -0.1, 10)
    assert stats.compare(neg, "A wins", "B wins", "tie").startswith("B wins: Δ = -0.30")
    tie = stats.compare(stats.Interval(0.3, -0.1, 0.5, 10), "A wins", "B wins", "A ties B")
    assert tie.startswith("A ties B (tie") and "A wins" not in tie


# --- planted sweep folders --------------------------------------------------------------------------

ITEMS = [f"q{i}" for i in range(8)]


def _sweep(root: Path, model: str, tables: dict[str, pd.DataFrame], family: str = "mdm_lens") -> None:
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({
        "model": {"id": model, "family": family}, "items_done": len(ITEMS),
        "arguments": {"probes": list(tables), "gen_length": 4, "steps": 4}}))
    for name, df in tables.items():
        df.to_parquet(root / f"{name}.parquet", index=False)


def _accuracy(gain: list[float]) -> pd.DataFrame:
    rows = []
    for i, (item, g) in enumerate(zip(ITEMS, gain)):
        with_ = 1.0 if g >= 0 else 0.0
        for cond, v in (("with_context", with_), ("no_context", with_ - g)):
            rows.append(dict(item_id=item, condition=cond, gold_index=i % 3, n_passages=3, metric="acc", value=v,
                             prediction="x"))
    return pd.DataFrame(rows)


def _knockout(anchor: list[float], random: list[float]) -> pd.DataFrame:
    rows = []
    for item, a, r in zip(ITEMS, anchor, random):
        for cond, e in (("clean", 0.0), ("anchors", a), ("random", r)):
            rows += [dict(item_id=item, metric="effect", condition=cond, step=None, value=e),
                     dict(item_id=item, metric="answer_logprob", condition=cond, step=None, value=-1.0 + e),
                     dict(item_id=item, metric="n_targets", condition=cond, step=0.0, value=0.0 if cond == "clean"
                          else 2.0)]
    return pd.DataFrame(rows)


def _qk(layers: dict[int, tuple[list[float], list[float]]]) -> pd.DataFrame:
    """Per layer: per-item (norm term, angle term), the same on both heads."""
    rows = []
    for layer, (norm, angle) in layers.items():
        for item, n, g in zip(ITEMS, norm, angle):
            for head in (0, 1):
                for m, v in (("norm_term", n), ("angle_term", g), ("advantage", n + g), ("anchor", 3.0)):
                    rows.append(dict(item_id=item, layer=layer, head=head, metric=m, value=v, label="x"))
    return pd.DataFrame(rows)


@pytest.fixture
def planted(tmp_path):
    ones = [1.0] * 8
    alt = [1.0, -1.0] * 4
    _sweep(tmp_path / "sweeps" / "a-main", "org/model-a", {
        "accuracy": _accuracy(ones),                                          # the passages always help A
        "knockout": _knockout([-2.0, -2.5, -1.5, -2.0, -3.0, -2.0, -1.0, -2.0], [-0.5] * 8),
        "qk": _qk({0: ([1.0] * 8, [2.0, 3.0] * 4), 1: ([1.0, 2.0] * 4, [2.0, 1.0] * 4)}),
        "retrieval": pd.DataFrame([dict(item_id=item, method="copy@commit", layer=0, head=h, metric="score",
                                        value=(0.5 if h == 1 else 0.0) if i % 2 else np.nan, correct=bool(i % 2))
                                   for i, item in enumerate(ITEMS) for h in (0, 1)])})
    _sweep(tmp_path / "sweeps" / "b-main", "org/model-b-arm", {
        "accuracy": _accuracy(alt),                                           # B: gain +1 / −1: a tie
        "qk": _qk({0: ([1.0] * 8, [1.0] * 8), 1: ([-1.0, 1.0] * 4, [0.0] * 8)})}, family="llama")
    (tmp_path / "sweeps" / "c-killed").mkdir()
    (tmp_path / "sweeps" / "c-killed" / "sweep.json").write_text("{}")
    return tmp_path / "sweeps"


class _Page(HTMLParser):
    """Per section: its title, finding text, 'not in this section' text, and claims table rows."""

    def __init__(self):
        super().__init__()
        self.sections, self.meta, self._cls, self._tag, self._row, self._cell, self._in = [], {}, [], None, None, "", None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append({"title": "", "finding": "", "absent": "", "claims": []})
        if tag in ("h2", "p") or (tag == "table" and a.get("class")):
            self._in = a.get("class", tag)
        if tag == "tr" and "claims" in (self._in or ""):
            self._row = []
        if tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
        if tag == "tr" and self._row is not None:
            if self._row and self.sections and any(self._row[1:]):   # not the index-name header row
                self.sections[-1]["claims"].append(self._row)
            self._row = None
        if tag in ("h2", "p", "table"):
            self._in = None

    def handle_data(self, data):
        self._cell += data
        if self.sections and self._in in ("h2", "finding", "absent"):
            key = {"h2": "title"}.get(self._in, self._in)
            self.sections[-1][key] += data


CLAIM = re.compile(r"(?P<text>[^;]*?)(?P<delta>[+-]\d+\.\d+)(?: [a-z]+)? \(95% CI (?P<ci>[+-]\d+\.\d+ to "
                   r"[+-]\d+\.\d+); n = (?P<n>\d+(?: \+ \d+)?) items")


def _parse(index: Path) -> _Page:
    page = _Page()
    page.feed(index.read_text())
    return page


def _by_title(page: _Page, start: str) -> dict:
    return next(s for s in page.sections if s["title"].split(". ", 1)[1].startswith(start))


def test_every_finding_sentence_matches_its_claims_table(planted, tmp_path):
    page = _parse(SR.report(planted, out=tmp_path / "r"))
    checked = 0
    for sec in page.sections:
        if not sec["claims"]:
            assert not sec["finding"], sec["title"]
            continue
        head, rows = ["comparison"] + sec["claims"][0][1:], sec["claims"][1:]
        found = list(CLAIM.finditer(sec["finding"]))
        assert len(found) == sum(r[head.index("verdict")] != "undefined" for r in rows), sec["title"]
        for m, row in zip(found, rows):
            r = dict(zip(head, row))
            assert (r["Δ"].split(" ")[0], r["95% CI"], r["n items"]) == (m["delta"], m["ci"], m["n"]), sec["title"]
            assert ("(tie" in m["text"]) == (r["verdict"] == "tie")
            assert ("Δ = " in m["text"]) == (r["verdict"] != "estimate")     # an estimate is no comparison
            lo, hi = (float(x) for x in m["ci"].split(" to "))
            if r["verdict"] != "estimate":
                assert r["verdict"] == ("positive" if lo > 0 else "negative" if hi < 0 else "tie")
            checked += 1
    assert checked >= 10
    ret = _by_title(page, "Retrieval")["finding"]          # 4 answered items; head 1 scores 0.5 on each
    assert "its best head, L0.H1 (picked as the largest mean, so optimistic), scores +0.50 (95% CI +0.50 to " \
           "+0.50; n = 4 items)" in ret


def test_planted_win_tie_and_sign(planted, tmp_path):
    page = _parse(SR.report(planted, out=tmp_path / "r"))
    acc = _by_title(page, "QA accuracy")["finding"]
    # A: gain 100 points on every item → the claim, with n and the (degenerate) interval
    assert "the passages help model-a: Δ = +100.0 points (95% CI +100.0 to +100.0; n = 8 items)" in acc
    # B: +1 / −1 → a tie, never "help"
    assert "model-b-arm scores alike with and without the passages (tie: the interval holds 0): Δ = +0.0" in acc
    assert "the passages help model-b-arm" not in acc
    # A − B: per item 0 or 2 (×100) → mean +100 points; its interval is off 0 here (checked independently)
    gain_a = pd.Series(1.0, index=ITEMS)
    gain_b = pd.Series([1.0, -1.0] * 4, index=ITEMS)
    iv = stats.difference(gain_a, gain_b)
    assert iv.estimate == 1.0 and iv.low > 0
    assert f"the passages help model-a more than model-b-arm: Δ = {iv.text(1, 100, 'points')}" in acc
    ko = _by_title(page, "Anchor knockout")
    # effect = knockout − clean as in the table: anchors −2 nats on average, random −0.5
    assert "knocking out model-a's anchors lowers the gold answer's log-prob: Δ = -2.00 nats" in ko["finding"]
    assert "model-a's anchor knockout leaves the gold answer's log-prob lower than a random-key knockout does: " \
           "Δ = -1.50 nats" in ko["finding"]
    assert "model-b-arm: no knockout table" in ko["absent"]
    qk = _by_title(page, "QK decomposition")["finding"]
    # layer 0 of A: advantage > 0 and G − N = +1.5 on every pair of items → the angle claim
    assert "the angle term carries more of model-a's layer-0 advantage than the norm term: Δ = +1.50" in qk
    # layer 1 of A: G − N = +1 / −1 → a tie, no claim
    assert "the angle and norm terms carry model-a's layer-1 advantage alike (tie" in qk
    assert "the angle term carries more of model-a's layer-1" not in qk
    # B layer 1: the advantage is −1 / +1 → no split is claimed at all
    assert "model-b-arm's top-1 key has no clear QK advantage at layer 1 (tie" in qk
    assert "model-b-arm's layer-1 advantage" not in qk
    assert page.sections and "c-killed: unfinished" in (tmp_path / "r" / "index.html").read_text()


def test_report_names_left_out_sweeps_and_refuses_an_empty_folder(planted, tmp_path):
    sweeps, left = SR.find_sweeps(planted)
    assert [s.label for s in sweeps] == ["model-a", "model-b-arm"]
    assert left == [("c-killed", "unfinished: sweep.json but no manifest.json (the merge never ran; rerun the "
                                 "sweep to resume it)")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no finished sweep"):
        SR.report(tmp_path / "empty")


def test_figure_titles_say_the_mode_and_absent_models_are_named(tmp_path, monkeypatch):
    rows = []
    for item in ITEMS:
        for mode, variant in (("default", "top1"), ("default", "pos0"), ("paper", "top1")):
            for layer in (0, 1):
                for m, v in (("absorption", 10.0), ("null", 4.0), ("excess", 6.0)):
                    rows.append(dict(item_id=item, layer=layer, mode=mode, variant=variant, metric=m, value=v))
    absorb = pd.DataFrame(rows)
    arm = absorb.assign(variant=absorb.variant.where(absorb["mode"] == "default", "pos0"))
    _sweep(tmp_path / "s" / "m", "x/tiny-mdm", {"absorption": absorb})
    _sweep(tmp_path / "s" / "a", "x/tiny-arm", {"absorption": arm, "temporal": pd.DataFrame(
        {"item_id": ["q0"], "layer": [0], "step": [0], "metric": ["n_anchors"], "value": [1.0]})}, family="llama")
    titles = []
    real = SR.sweep_layers.figures.absorption_by_layer
    monkeypatch.setattr(SR.sweep_layers.figures, "absorption_by_layer",
                        lambda *a, **kw: titles.append(kw["title"]) or real(*a, **kw))
    page = _parse(SR.report(tmp_path / "s", out=tmp_path / "r"))
    assert titles == ["Absorption by layer (default mode, top1 for every model)",
                      "Absorption by layer, paper mode (anchor rules differ: pos0, top1)"]
    assert "tiny-arm absorbs more than uniform attention would (top1): Δ = +6.0 points" in \
        _by_title(page, "Absorption")["finding"]
    temporal = _by_title(page, "Temporal")
    assert temporal["absent"].startswith("Not in this section: tiny-arm: a causal model")


# --- summaries --------------------------------------------------------------------------------------

def test_jaccard_of_two_empty_sets_is_excluded_and_counted():
    # steps' anchor sets ∅ ∅ {0,1} {1,2}: pairs (∅, ∅) undefined, (∅, S) 0, (S, S') 1/3. The probe itself leaves
    # the empty pair out (NaN, nan-mean), so its mean_jaccard is 1/6 and jaccard_defined is that same 1/6 (the
    # summary once removed the empty pair a second time: (1/6·3 − 1)/2 = −1/4)
    from mdm_lens.probes.drift import drift

    sets = [[], [], [0, 1], [1, 2]]
    anchors = torch.zeros(4, 4, dtype=torch.bool)
    for s, keys in enumerate(sets):
        anchors[s, keys] = True
    probe_mean = float(drift(anchors, torch.full((4, 4), 0.25)).mean_jaccard)
    assert probe_mean == pytest.approx(1 / 6)
    rows = [dict(item_id="a", layer=0, step=s, metric="n_anchors", value=float(len(k))) for s, k in enumerate(sets)]
    rows += [dict(item_id="a", layer=0, step=None, metric="mean_jaccard", value=probe_mean)]
    rows += [dict(item_id="b", layer=0, step=s, metric="n_anchors", value=0.0) for s in range(3)]  # all empty
    rows += [dict(item_id="b", layer=0, step=None, metric="mean_jaccard", value=float("nan"))]
    rows += [dict(item_id="c", layer=0, step=0, metric="n_anchors", value=2.0),   # one step: no pair at all
             dict(item_id="c", layer=0, step=None, metric="mean_jaccard", value=float("nan"))]
    t = pd.DataFrame(rows).astype({"step": "Int64"})
    jd = summary.jaccard_defined(t).set_index(["item_id", "metric"])["value"]
    assert jd[("a", "jaccard_defined")] == pytest.approx(1 / 6) and jd[("a", "n_empty_pairs")] == 1.0
    assert np.isnan(jd[("b", "jaccard_defined")]) and jd[("b", "n_empty_pairs")] == 2.0
    assert np.isnan(jd[("c", "jaccard_defined")]) and np.isnan(jd[("c", "n_empty_pairs")])  # undefined, not 0
    s = summary.summarize({"temporal": t})["temporal"].set_index("metric")
    assert s.loc["jaccard_defined", "mean"] == pytest.approx(1 / 6)
    assert (s.loc["jaccard_defined", "n"], s.loc["jaccard_defined", "n_excluded"]) == (1, 2)  # b (all empty) and c (no pair)


def test_summaries_never_average_positions_or_mix_passage_counts():
    t = pd.DataFrame([dict(item_id=i, layer=0, step=0, metric=m, value=v) for i, v in (("a", 3.0), ("b", 40.0))
                      for m in ("top1_key", "top1_mass")]).astype({"step": "Int64"})
    assert set(summary.summarize({"temporal": t})["temporal"].metric) == {"top1_mass"}
    acc = pd.DataFrame([dict(item_id=i, condition="with_context", gold_index=1, n_passages=k, metric="acc", value=v,
                             prediction="") for i, k, v in (("a", 2, 1.0), ("b", 10, 0.0))])
    s = summary.summarize({"accuracy": acc})["accuracy"]
    pos = s[s.group == "by_gold_position"]
    assert pos[["n_passages", "gold_index", "mean", "n"]].values.tolist() == [[2, 1, 1.0, 1], [10, 1, 0.0, 1]]
    assert not schema.check({"accuracy_summary": s})


def test_flow_summary_counts_an_item_with_two_gold_passages_once():
    rows = [dict(item_id="a", gold_index=0, region=r, kind=k, metric="answer_density", value=v)
            for r, k, v in (("doc1", "gold", 2.0), ("doc2", "gold", 4.0), ("doc3", "doc", 1.0))]
    rows += [dict(item_id="b", gold_index=0, region="doc1", kind="gold", metric="answer_density", value=6.0)]
    s = summary.summarize({"flow": pd.DataFrame(rows)})["flow"].set_index("region")
    assert s.loc["gold doc", "mean"] == 4.5 and s.loc["gold doc", "n"] == 2     # (3 + 6) / 2, not (2 + 4 + 6) / 3


# --- schema -----------------------------------------------------------------------------------------

def test_readme_schema_block_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(schema.README_START) + len(schema.README_START):text.index(schema.README_END)]
    assert block.strip() == schema.markdown().strip()


def test_conform_refuses_undeclared_columns_and_write_puts_the_schema_beside(tmp_path):
    with pytest.raises(ArgumentError, match="does not declare"):
        schema.conform("qk", pd.DataFrame({"item_id": ["a"], "surprise": [1]}))
    df = schema.conform("knockout", pd.DataFrame({"item_id": ["a"], "metric": ["effect"], "condition": ["clean"],
                                                  "step": [np.nan], "value": [0.0]}))
    assert str(df.step.dtype) == "Int64" and not schema.check({"knockout": df})
    paths = schema.write(tmp_path, {"knockout": df})
    info = json.loads(paths[0].read_text())
    assert info["columns"]["step"]["dtype"] == "Int64" and "knockout" in info["tables"]
    assert "`effect`" in paths[1].read_text()


@pytest.fixture(scope="module")
def nogold_sweep(tmp_path_factory):
    """A real sweep (tiny random MDM; every probe but knockout, the slow one, whose columns the planted test
    checks, and retrieval, which refuses items without a gold passage: tests/test_sweep_data.py) on KILT-like
    items that name no gold passage."""
    import torch

    from mdm_lens import HookedMDM, MDMConfig, sweep
    from mdm_lens.zoo import tokenizer as ZT

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, d_vocab=ZT.vocab_size(), n_ctx=128,
                    attention="bidirectional", mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID,
                    eos_token_id=ZT.EOS_ID, pad_token_id=ZT.PAD_ID, family="mdm_lens", model_name="stand-in-mdm",
                    extra={"gen_length": 4, "prepend_bos": False})
    torch.manual_seed(0)
    model = HookedMDM.from_config(cfg, seed=0, init_std=0.2, tokenizer=ZT.load_tokenizer())
    root = tmp_path_factory.mktemp("nogold")
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps({"id": f"k{i}", "question": f"where is {c} ?", "answers": [c],
                                        "passages": [{"segment": f"the city of {c} lies in palundra ."},
                                                     {"segment": "varek owns a pet otter ."}]}) + "\n"
                            for i, c in enumerate(("ketterby", "wistmere"))))
    tables = sweep.run(model, data, "accuracy,absorption,temporal,qk,flow", root / "s" / "m",
                       batch_size=2, progress=False)
    return root, tables


def test_real_tables_fit_the_schema(nogold_sweep):
    _, tables = nogold_sweep
    for name, df in tables.items():
        assert set(df.columns) <= set(schema.table_columns(name)), name
        if name.endswith("_summary"):
            assert not schema.check({name: df}), name               # summaries are written in schema dtypes
    conformed = {n: schema.conform(n, df) for n, df in tables.items()}
    assert not schema.check(conformed)
    assert conformed["accuracy"].gold_index.isna().all()


def test_report_on_data_without_gold_indices(nogold_sweep):
    root, _ = nogold_sweep
    page = _parse(SR.report(root / "s", out=root / "r"))
    text = (root / "r" / "index.html").read_text()
    assert "No item names a gold passage (with-context items naming one: stand-in-mdm 0 of 2)" in H.unescape(text)
    assert "no item names a gold passage, so no flow-by-gold-position figure" in text
    flow = _by_title(page, "Region-level")["finding"]
    assert "undecided" in flow and "2 excluded" in flow                  # gold ratio: undefined, counted


# --- import cycles ----------------------------------------------------------------------------------

def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mdm_lens"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mdm_lens")}
    return out


def test_sweep_and_views_have_no_import_cycle():
    mods = {f"mdm_lens.{p.parent.name}.{p.stem}": p for d in ("sweep", "views")
            for p in (ROOT / "mdm_lens" / d).glob("*.py") if p.stem != "__init__"}
    graph = {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}
    assert "mdm_lens.sweep.adapter" not in graph["mdm_lens.sweep.tables"]

    def visit(m, stack):
        assert m not in stack, " -> ".join(stack + [m])
        for n in graph[m]:
            visit(n, stack + [m])
    for m in graph:
        visit(m, [])


def test_a_registered_section_follows_its_anchor_and_names_absent_models(planted, tmp_path, monkeypatch):
    monkeypatch.setattr(SR, "SECTIONS", list(SR.SECTIONS))
    from mdm_lens.views.report import Section

    seen = []
    SR.register_section("extra", lambda sweeps, img: seen.append([s.label for s in sweeps]) or Section("Lens", "x"),
                        tables="qk", skip=lambda s: "not a lens model" if s.causal else None, after="qk")
    keys = [s.key for s in SR.SECTIONS]
    assert keys.index("extra") == keys.index("qk") + 1
    page = _parse(SR.report(planted, out=tmp_path / "r"))
    assert seen == [["model-a"]]
    assert _by_title(page, "Lens")["absent"] == "Not in this section: model-b-arm: not a lens model."
    with pytest.raises(ArgumentError, match="after"):
        SR.register_section("x", lambda s, i: None, tables="qk", after="nope")
