"""Sweep input trust: gold SETS, conflicting markers and ambiguous lines are errors (never a silent pick), the
needle is the earliest gold-answer match in absolute prompt offsets, items a probe cannot use are refused or (with
``--skip-bad``) skipped with their reason, a failed validation writes nothing, and the manifest says what ran."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mdm_lens.errors import ArgumentError, InputError
from mdm_lens import sweep
from mdm_lens.probes import run as R
from mdm_lens.sweep import templates as TM
from mdm_lens.zoo import jsonl
from test_sweep_resume import _one_thread  # noqa: F401  (autouse: one BLAS thread for many short runs)


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _read_one(tmp_path, line):
    return sweep.read_items(_write(tmp_path / "one.jsonl", [line])).items[0]


# --- reading ------------------------------------------------------------------------------------------------

def test_several_gold_passages_are_all_gold(tmp_path):
    flagged = _read_one(tmp_path, {"question": "q", "answers": ["a"],
                                   "passages": [{"text": "p0", "is_gold": True}, {"text": "p1"},
                                                {"text": "p2", "has_answer": True}]})
    assert flagged.gold_indices == (0, 2) and flagged.gold_index == 0
    listed = _read_one(tmp_path, {"question": "q", "answers": ["a"], "passages": ["p0", "p1", "p2"],
                                  "gold_index": [2, 1]})
    assert listed.gold_indices == (1, 2) and listed.gold_index == 1
    agree = _read_one(tmp_path, {"question": "q", "passages": [{"text": "p0", "gold": True}, "p1"], "gold_idx": 0})
    assert agree.gold_indices == (0,)


@pytest.mark.parametrize("line, reason", [
    ({"question": "q", "passages": [{"text": "p0", "gold": True}, "p1"], "gold_index": 1},
     "conflicting gold markers: the gold index says [1] but the passages flag [0]"),
    ({"question": "q", "passages": [{"text": "p0", "gold": True, "is_gold": False}]},
     "conflicting gold markers on passage 0: gold=True, is_gold=False"),
    ({"question": "q", "passages": [{"text": "p0", "gold": False}, "p1"], "gold_index": 0},
     "and [0] as not gold"),
    ({"question": "q", "passages": ["p0", "p1"], "gold_index": 0, "gold_idx": 1},
     "conflicting gold passage indices: gold_index=0 and gold_idx=1"),
    ({"question": "q", "gold_index": 0}, "none: the item has no passages"),
    ({"question": "q", "passages": ["p0"], "gold_index": 3}, "a passage index in 0..0"),
    ({"question": "q", "prompt": "free text"}, "both a prompt and a question"),
    ({"prompt": "free text", "passages": ["p0"]}, "cannot carry passages"),
    ({"question": "q one", "query": "q two"}, "conflicting questions: question=\"q one\" and query=\"q two\""),
    ({"question": "q", "passages": ["p0", "  "]}, "passage 1 is empty"),
])
def test_ambiguous_lines_are_errors_naming_the_line(tmp_path, line, reason):
    path = _write(tmp_path / "bad.jsonl", [{"question": "fine", "answers": ["x"]}, line])
    with pytest.raises(InputError) as e:
        sweep.read_items(path)
    assert "bad.jsonl:2: " in str(e.value) and reason in str(e.value)
    skipped = sweep.read_items(path, skip_bad=True).skipped
    assert len(skipped) == 1 and skipped[0]["line"] == 2 and reason in skipped[0]["reason"]


def test_answer_aliases_are_joined_not_dropped(tmp_path):
    it = _read_one(tmp_path, {"question": "q", "answer": "Paris", "answers": ["Paris", "paris city"]})
    assert it.answers == ("Paris", "paris city")


# --- the needle ---------------------------------------------------------------------------------------------

class _Cfg:
    family, bos_token_id, extra = "llada", None, {}


def _fake_model(tokenizer):
    class M:
        cfg, tokenizer = _Cfg(), None
    m = M()
    m.tokenizer = tokenizer
    return m


@pytest.mark.parametrize("template", ["rag", "zoo"])
def test_needle_is_the_earliest_answer_in_a_gold_passage_not_at_offset_0(mdm, template):
    # gold passage 1 starts well after offset 0, and the 1st answer "beta" occurs before the 2nd, "delta", in it.
    # Comparing the passage-relative start of "delta" with the absolute start of "beta" picked "delta".
    model = _fake_model(mdm.tokenizer) if template == "rag" else mdm
    item = sweep.SweepItem(id="a", line=1, question="which one ?", passages=("alpha gamma", "zeta beta eta delta"),
                           answers=("beta", "delta"), gold_indices=(1,))
    qa = TM.render(model, item, template).qa
    assert qa.passage_spans[1][0] > len("zeta ") + 10
    assert qa.prompt[slice(*qa.evidence_span)] == "beta"
    assert qa.evidence_span[0] == qa.passage_spans[1][0] + len("zeta ")
    assert qa.answer == "beta"
    # several gold passages: the earliest match over all of them, in prompt order; ``answer`` is the one it matched
    two = sweep.SweepItem(id="b", line=1, question="q ?", passages=("x y", "one delta", "beta two"),
                          answers=("beta", "delta"), gold_indices=(1, 2))
    qa = TM.render(model, two, template).qa
    assert qa.gold_indices == (1, 2) and qa.evidence_span[0] == qa.passage_spans[1][0] + len("one ")
    assert qa.answer == "delta" and qa.answers == ("delta", "beta")
    kinds = [r.kind for r in R.regions_for_item(qa, 0, TM.encode_with_offsets(mdm, qa.prompt, "zoo")[1])
             if r.name.startswith("doc")]
    assert kinds == ["doc", "gold", "gold"]


# --- items a probe cannot use ---------------------------------------------------------------------------------

def _mixed(tmp_path):
    good = [json.loads(x) for x in (tmp_path / "good.jsonl").read_text().splitlines()]
    long = dict(good[1], id="long", passages=[{"segment": " ".join(["red"] * 130)}], gold_index=0)
    lines = [good[0],
             dict(good[1], id="noans", answers=[]),                                   # accuracy: no answers
             dict(good[2], id="closed", passages=[], gold_index=None),                # retrieval: closed-book
             dict(good[3], id="unk", answers=["zyxwv"]),                              # <unk> answer
             long,                                                                    # too long for n_ctx 128
             good[4]]
    return _write(tmp_path / "mixed.jsonl", lines)


def test_items_a_probe_cannot_use_are_refused_or_skipped_with_their_reason(mdm, tmp_path):
    jsonl.export(tmp_path / "good.jsonl", 5, seed=34)
    path = _mixed(tmp_path)
    with pytest.raises(InputError, match=r"mixed.jsonl:2: item 'noans': probe 'accuracy' needs answers"):
        sweep.run(mdm, path, "accuracy", tmp_path / "o", progress=False)
    with pytest.raises(InputError, match=r"mixed.jsonl:4: item 'unk': gold answer 'zyxwv' tokenizes to the unknown"):
        sweep.run(mdm, path, "knockout", tmp_path / "o", progress=False)
    with pytest.raises(InputError, match=r"mixed.jsonl:5: item 'long': 142 prompt tokens \+ gen_length 4 exceed"):
        sweep.run(mdm, path, "absorption", tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()                       # a refused run leaves nothing behind
    tabs = sweep.run(mdm, path, "accuracy,retrieval", tmp_path / "o", skip_bad=True, progress=False)
    skipped = tabs["skipped"].set_index("item_id")
    assert sorted(skipped.index) == ["closed", "long", "noans", "unk"]
    assert "probe 'accuracy' needs answers" in skipped.loc["noans", "reason"]
    assert "closed-book (no passages)" in skipped.loc["closed", "reason"]
    assert "exceed the model's context of 128" in skipped.loc["long", "reason"]
    assert "unknown token (id 4)" in skipped.loc["unk", "reason"]
    assert skipped.loc["unk", "line"] == 4
    man = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert man["items_skipped"] == 4 and man["items_done"] == 2
    assert {d["item_id"] for d in man["skipped"]} == set(skipped.index)
    assert set(tabs["accuracy"].item_id) == {"zoo-34-00000", "zoo-34-00004"}
    # absorption alone can use the unk and no-answer items: only the too-long one is skipped
    tabs = sweep.run(mdm, path, "absorption", tmp_path / "a", skip_bad=True, progress=False)
    assert tabs["skipped"].item_id.tolist() == ["long"] and tabs["absorption"].item_id.nunique() == 5


def test_limit_counts_usable_items(mdm, tmp_path):
    jsonl.export(tmp_path / "good.jsonl", 5, seed=34)
    tabs = sweep.run(mdm, _mixed(tmp_path), "accuracy", tmp_path / "o", skip_bad=True, limit=2, progress=False)
    assert tabs["accuracy"].item_id.unique().tolist() == ["zoo-34-00000", "closed"]     # closed-book: fine here
    assert tabs["skipped"].item_id.tolist() == ["noans"]             # items past the limit are not even looked at
    tabs = sweep.run(mdm, _mixed(tmp_path), "accuracy,retrieval", tmp_path / "r", skip_bad=True, limit=2,
                     progress=False)
    assert tabs["accuracy"].item_id.unique().tolist() == ["zoo-34-00000", "zoo-34-00004"]


def test_passages_past_max_passages_are_recorded_and_a_dropped_gold_is_refused(mdm, tmp_path):
    lines = [{"id": "shown", "question": "who ?", "answers": ["red"], "gold_index": 1,
              "passages": ["a red", "b red", "c", "d", "e"]},
             {"id": "lost", "question": "who ?", "answers": ["red"], "gold_index": 4,
              "passages": ["a", "b", "c", "d", "e red"]}]
    path = _write(tmp_path / "p.jsonl", lines)
    with pytest.raises(InputError, match=r"p.jsonl:2: item 'lost': gold passage\(s\) \[5\] of 5 are past "
                                         r"max_passages=3"):
        sweep.run(mdm, path, "absorption", tmp_path / "o", template="rag", max_passages=3, progress=False)
    tabs = sweep.run(mdm, path, "absorption", tmp_path / "o", template="rag", max_passages=3, skip_bad=True,
                     progress=False)
    assert tabs["skipped"].item_id.tolist() == ["lost"] and tabs["absorption"].item_id.unique().tolist() == ["shown"]
    man = json.loads((tmp_path / "o" / "manifest.json").read_text())
    # the rag instruction's words are outside the tiny vocabulary: that is flagged too (tests/test_misuse26_helper.py)
    assert man["warnings"][0] == {"item_id": "shown", "line": 1, "warning": "passages 4..5 of 5 not shown "
                                                                            "(max_passages=3)"}
    assert len(man["warnings"]) == 2 and "tokenizer's unknown token" in man["warnings"][1]["warning"]


# --- state, manifest, tables ------------------------------------------------------------------------------------

def test_a_failed_validation_leaves_no_state_that_forces_force(mdm, tmp_path, monkeypatch):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 3, seed=34)
    with pytest.raises(ArgumentError, match="block_length"):             # the sampler's check, before any write
        sweep.run(mdm, data, "absorption", tmp_path / "o", block_length=3, progress=False)
    assert not (tmp_path / "o").exists()
    from mdm_lens.sweep import adapter as A

    def boom(*a, **k):
        raise RuntimeError("planted failure in the first batch")

    monkeypatch.setattr(A, "compute", boom)
    with pytest.raises(RuntimeError, match="planted"):
        sweep.run(mdm, data, "absorption", tmp_path / "o", progress=False)
    monkeypatch.undo()
    tabs = sweep.run(mdm, data, "qk", tmp_path / "o", batch_size=2, progress=False)     # other args, no --force
    assert set(tabs) == {"qk", "qk_summary", "skipped"}
    with pytest.raises(ArgumentError, match="differs in: batch_size, probes"):         # now there are results
        sweep.run(mdm, data, "absorption", tmp_path / "o", progress=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArgumentError, match="is a file, not a folder"):
        sweep.run(mdm, data, "absorption", tmp_path / "f", progress=False)


def test_manifest_records_what_ran(arm, mdm, tmp_path):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 2, seed=34)
    sweep.run(arm, data, "accuracy", tmp_path / "a", progress=False)   # (an explicit steps=2 is refused on an ARM)
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert man["asked"]["steps"] is None and man["asked"]["dtype"] is None
    assert man["arguments"]["steps"] == 4 and man["arguments"]["dtype"] == "float32"    # ARM decodes gen_length steps
    assert man["ran"]["device"] == "cpu" and man["ran"]["dtype"] == "float32"
    assert [s["sampler"] for s in man["ran"]["sampler"]] == ["arm"] and man["ran"]["sampler"][0]["steps"] == 4
    assert "seed" not in man["ran"]["sampler"][0]
    sweep.run(mdm, data, "knockout", tmp_path / "m", steps=2, limit=1, progress=False)
    ran = json.loads((tmp_path / "m" / "manifest.json").read_text())["ran"]["sampler"]
    assert {(s["sampler"], s["steps"], s["gen_length"], s["block_length"]) for s in ran} == {("llada", 2, 4, 4)}
    assert "generate" not in vars(mdm)                                                # the model is restored
    with pytest.raises(ArgumentError, match="dtype='bfloat16' but the model passed is in float32"):
        sweep.run(mdm, data, "absorption", tmp_path / "x", dtype="bfloat16", progress=False)


def test_tables_carry_the_gold_set(mdm, tmp_path):
    lines = [{"id": "two", "question": "colour ?", "answers": ["red"], "gold_index": [0, 2],
              "passages": ["the red one", "blue", "red again"]},
             {"id": "none", "question": "colour ?", "answers": ["red"], "passages": ["blue"]}]
    tabs = sweep.run(mdm, _write(tmp_path / "g.jsonl", lines), "accuracy,flow", tmp_path / "o", progress=False)
    acc = tabs["accuracy"].drop_duplicates("item_id").set_index("item_id")
    assert acc.loc["two", "gold_indices"] == "0,2" and acc.loc["none", "gold_indices"] == ""
    assert acc.loc["two", "gold_index"] == 0 and pd.isna(acc.loc["none", "gold_index"])
    flow = tabs["flow"][(tabs["flow"].item_id == "two") & (tabs["flow"].metric == "answer_row")]
    assert flow[flow.kind == "gold"].region.tolist() == ["doc1", "doc3"]
    assert set(tabs["flow"].gold_indices) == {"0,2", ""}


def test_score_takes_the_best_accepted_answer_and_nan_without_items():
    from mdm_lens import items as I

    it = I.QAItem(question="q", answer="paris", passages=[], gold_index=None, prompt="q", passage_spans=[],
                  question_span=(0, 1), evidence_span=None, answers=("paris", "city of light"))
    res = I.score(["the city of light", "paris"], [it, it])
    assert (res["exact_match"], res["substring_match"], res["f1"], res["n"]) == (1.0, 1.0, 1.0, 2.0)
    empty = I.score([], [])
    assert empty["n"] == 0 and all(empty[k] != empty[k] for k in ("exact_match", "substring_match", "f1"))  # NaN
