"""Report sections computed from planted sweep tables: the numbers in the table, the figure's bars and the
finding sentence are the planted ones."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from mdm_lens.views import sweep_sections as SS


def _knockout_table() -> pd.DataFrame:
    """Two items; answer log-prob clean/anchors/random = (-1, -4, -1.5) and (-2, -3, -2.5)."""
    rows = []
    planted = {"i0": {"clean": -1.0, "anchors": -4.0, "random": -1.5},
               "i1": {"clean": -2.0, "anchors": -3.0, "random": -2.5}}
    em = {"clean": 1.0, "anchors": 0.0, "random": 1.0}
    for item, conds in planted.items():
        for cond, lp in conds.items():
            rows += [dict(item_id=item, condition=cond, metric="answer_logprob", step=None, value=lp),
                     dict(item_id=item, condition=cond, metric="exact_match", step=None, value=em[cond]),
                     dict(item_id=item, condition=cond, metric="agreement", step=None, value=0.5),
                     dict(item_id=item, condition=cond, metric="answer_rank", step=None, value=2.0),
                     dict(item_id=item, condition=cond, metric="tf_answer_logprob_mean", step=None, value=lp / 2),
                     # the old per-step margin, deliberately different: the section must not plot it
                     dict(item_id=item, condition=cond, metric="metric_mean", step=None, value=100.0)]
            rows += [dict(item_id=item, condition=cond, metric="n_targets", step=s, value=0.0 if cond == "clean"
                          else 3.0) for s in (0, 1)]
    return pd.DataFrame(rows)


def test_knockout_section_plots_the_effect_with_the_tables_sign(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(SS.figures, "knockout_effect",
                        lambda labels, a, r, ae, re, **kw: drawn.update(labels=labels, a=a, r=r, ae=ae, re=re, **kw))
    sweep = SimpleNamespace(label="tiny-mdm", table=lambda name: _knockout_table() if name == "knockout" else None)
    sec = SS.knockout_section([sweep], tmp_path)
    # effect = knockout − clean (knockout.parquet's sign): anchors (−3, −1) → mean −2, resampled means −3/−2/−1
    # → 95% CI [−3, −1]; random (−0.5, −0.5) → −0.5, CI [−0.5, −0.5]
    assert drawn["a"].tolist() == [-2.0] and drawn["r"].tolist() == [-0.5]
    assert drawn["ae"].tolist() == [[1.0], [1.0]] and drawn["re"].tolist() == [[0.0], [0.0]]
    assert "knockout − clean" in drawn["ylabel"]
    t = sec.table.set_index("condition")
    assert t.loc["anchors", "effect (knockout − clean, nats)"] == -2.0 and t.loc["clean", "answer log-prob"] == -1.5
    assert t.loc["anchors", "teacher-forced answer log-prob"] == -1.75
    assert t.loc["anchors", "exact match"] == 0.0 and t.loc["random", "exact match"] == 1.0
    assert t.loc["anchors", "keys knocked per row"] == 3.0 and t.loc["clean", "items"] == 2
    assert ("knocking out tiny-mdm's anchors lowers the gold answer's log-prob: Δ = -2.00 nats (95% CI -3.00 to "
            "-1.00; n = 2 items)") in sec.finding
    assert ("tiny-mdm's anchor knockout leaves the gold answer's log-prob lower than a random-key knockout does: "
            "Δ = -1.50 nats (95% CI -2.50 to -0.50; n = 2 items)") in sec.finding
    assert sec.claims.verdict.tolist() == ["negative", "negative"]


def test_knockout_section_reads_the_effect_rows_when_present(tmp_path, monkeypatch):
    monkeypatch.setattr(SS.figures, "knockout_effect", lambda *a, **kw: None)
    t = _knockout_table()
    eff = t[t.metric == "answer_logprob"].copy()
    eff["metric"] = "effect"
    eff["value"] = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]          # planted: the knockouts *raise* it, unlike answer_logprob
    t = pd.concat([t, eff], ignore_index=True)
    sec = SS.knockout_section([SimpleNamespace(label="m", table=lambda name: t)], tmp_path)
    assert "knocking out m's anchors raises the gold answer's log-prob: Δ = +1.00 nats" in sec.finding
    assert "m's anchor and random-key knockouts leave it alike (tie" in sec.finding


def test_knockout_section_names_models_with_nothing_knocked(tmp_path, monkeypatch):
    monkeypatch.setattr(SS.figures, "knockout_effect", lambda *a, **kw: None)
    t = _knockout_table()
    t.loc[t.metric == "n_targets", "value"] = 0.0
    sec = SS.knockout_section([SimpleNamespace(label="m", table=lambda name: t)], tmp_path)
    assert "Bars at 0 for m" in sec.text
    assert SS.knockout_section([SimpleNamespace(label="m", table=lambda name: None)], tmp_path) is None
