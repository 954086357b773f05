"""`mdm_lens.sweep`: every probe's sweep rows equal the probe called on the item alone (so a left-padded
batched item equals the item alone), inputs, templates, errors, folder checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mdm_lens import ReceivedAttention
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.probes import patching, retrieval
from mdm_lens.probes import run as R
from mdm_lens import sweep
from mdm_lens.sweep import templates as TM
from mdm_lens.zoo import data as D
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT

SEED = 34    # zoo items 0..5 of seed 34: prompt lengths 50 53 53 51 55 50 → batch_size 4: [0 5 1 2] [3 4];
#              tiny-mdm answers items 1, 2 and 4 (so retrieval scores are counted, batched and alone)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    items = jsonl.export(path, 6, seed=SEED)
    return path, items


@pytest.fixture(scope="module")
def mdm_tables(mdm, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    return sweep.run(mdm, data[0], "accuracy,absorption,temporal,qk,retrieval,flow", out, batch_size=4,
                     progress=False)


def alone(model, item):
    ids = torch.tensor(ZT.encode(item.prompt))
    return ids, R.generate_final(model, [ids])


def rows(df, **eq):
    for k, v in eq.items():
        df = df[df[k] == v]
    return df


def test_zoo_template_renders_the_zoo_prompt(mdm, data):
    path, items = data
    for it, qa in zip(sweep.read_items(path).items, items):
        r = TM.render(mdm, it, "zoo")
        assert r.text == qa.prompt and r.ids == ZT.encode(qa.prompt)
        assert (r.qa.passage_spans, r.qa.marker_spans, r.qa.question_span, r.qa.evidence_span) == \
               (qa.passage_spans, qa.marker_spans, qa.question_span, qa.evidence_span)
        closed = TM.render(mdm, it, "zoo", context=False)
        assert closed.text == f"{D.BOS} {D.QUESTION_CUE} {qa.question} {D.ANSWER_PREFIX}"


def test_rag_template_spans(mdm):
    item = sweep.SweepItem(id="a", line=1, question="who wrote it ?", passages=("alpha beta", "gamma delta"),
                           answers=("delta",), gold_index=1)

    class Cfg:
        family, bos_token_id, extra = "llada", None, {}

    class M:
        cfg, tokenizer = Cfg(), mdm.tokenizer

    r = TM.render(M(), item, "rag")
    qa = r.qa
    assert [qa.prompt[s:e] for s, e in qa.passage_spans] == ["alpha beta", "gamma delta"]
    assert [qa.prompt[s:e] for s, e in qa.marker_spans] == ["Passage 1:", "Passage 2:"]
    assert qa.prompt[slice(*qa.question_span)] == "who wrote it ?" and qa.prompt.endswith("\n\nShort Answer:")
    assert qa.prompt[slice(*qa.evidence_span)] == "delta" and qa.gold_index == 1
    closed = TM.render(M(), item, "rag", context=False).qa
    assert TM.PLACEHOLDER in closed.prompt and closed.gold_index is None and closed.passage_spans == []


def test_readers_accept_kilt_af_and_prompt_lines(tmp_path):
    lines = [{"id": "k1", "input": "q one", "output": [{"answer": "A"}, {"provenance": []}],
              "passage": [{"segment": "s0"}, {"title": "T", "segment": "s1", "has_answer": True}]},
             {"question": "q two", "answers": [["B", "b2"]], "passages": ["p0", "p1", "p2"], "gold_idx": 2},
             {"query": "q three", "answer": {"text": "C"}},
             {"id": 7, "prompt": "free text"}]
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = sweep.read_items(p).items
    assert [g.id for g in got] == ["k1", "line2", "line3", "7"]
    assert got[0].answers == ("A",) and got[0].passages == ("s0", "T: s1") and got[0].gold_index == 1
    assert got[1].answers == ("B", "b2") and got[1].gold_index == 2
    assert got[2].passages == () and got[2].answers == ("C",) and got[2].gold_index is None
    assert got[3].prompt == "free text" and not got[3].is_qa


def test_bad_lines_name_file_and_line_or_are_skipped(mdm, data, tmp_path):
    p = tmp_path / "bad.jsonl"
    good = data[0].read_text().splitlines()
    p.write_text("\n".join([good[0], "{not json", good[1], json.dumps({"id": "x"}), good[1]]) + "\n")
    with pytest.raises(InputError, match=rf"bad.jsonl:2: not valid json"):
        sweep.read_items(p)
    r = sweep.read_items(p, skip_bad=True)
    assert [s["line"] for s in r.skipped] == [2, 4, 5] and "duplicate id" in r.skipped[2]["reason"]
    tabs = sweep.run(mdm, p, "absorption", tmp_path / "o", skip_bad=True, progress=False)
    man = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert man["items_skipped"] == 3 and man["items_done"] == 2 and tabs["absorption"].item_id.nunique() == 2


def test_bad_options_fail_before_the_model_loads(data, tmp_path):
    with pytest.raises(ArgumentError, match="probes"):
        sweep.run("no/such-model", data[0], "absorption,attention", tmp_path / "o")
    with pytest.raises(ArgumentError, match="batch_size"):
        sweep.run("no/such-model", data[0], "absorption", tmp_path / "o", batch_size=0)
    with pytest.raises(ArgumentError, match="dtype"):
        sweep.run("no/such-model", data[0], "absorption", tmp_path / "o", dtype="fp17")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    with pytest.raises(InputError, match=r"p.jsonl:1: item 'a': probe 'flow' needs"):
        sweep.run("no/such-model", prompts, "flow", tmp_path / "o")


def test_other_arguments_refused_unless_force(mdm, data, tmp_path):
    sweep.run(mdm, data[0], "absorption", tmp_path / "o", limit=1, progress=False)
    with pytest.raises(ArgumentError, match="differs in: probes"):
        sweep.run(mdm, data[0], "qk", tmp_path / "o", limit=1, progress=False)
    tabs = sweep.run(mdm, data[0], "qk", tmp_path / "o", limit=1, force=True, progress=False)
    assert "absorption" not in tabs and "qk" in tabs


def test_absorption_rows_equal_the_probe_alone(mdm, data, mdm_tables):
    df = mdm_tables["absorption"]
    for i, item in enumerate(data[1]):
        _, (toks, am, _) = alone(mdm, item)
        for mode in ("default", "paper"):
            res = R.absorption_by_layer(mdm, toks, attention_mask=am, mode=mode)
            for vi, v in enumerate(res.variants):
                got = rows(df, item_id=f"zoo-{SEED}-{i:05d}", mode=mode, variant=v, metric="absorption")
                np.testing.assert_allclose(got.sort_values("layer").value, res.per_sample[0, :, vi], atol=1e-4)
                got = rows(df, item_id=f"zoo-{SEED}-{i:05d}", mode=mode, variant=v, metric="null")
                np.testing.assert_allclose(got.sort_values("layer").value, res.null[0, :, vi], atol=1e-9)


def test_temporal_qk_rows_equal_the_probes_alone(mdm, data, mdm_tables):
    t, q, keys = mdm_tables["temporal"], mdm_tables["qk"], mdm_tables["temporal_keys"]
    for i, item in enumerate(data[1]):
        iid = f"zoo-{SEED}-{i:05d}"
        ids, (toks, am, _) = alone(mdm, item)
        out = mdm.generate(ids, steps=4, gen_length=4, record=[ReceivedAttention()])
        for layer in range(mdm.cfg.n_layers):
            sa = R.anchors_over_steps(out, layer=layer)
            got = rows(t, item_id=iid, layer=layer)
            assert rows(got, metric="n_anchors").value.tolist() == sa.anchors[0].sum(-1).tolist()
            assert rows(got, metric="top1_key").value.tolist() == sa.received[0].argmax(-1).tolist()
            dr = R.drift_from_output(out, layer=layer)
            for m in ("mean_jaccard", "n_distinct", "modal_anchor", "centroid_slope"):
                want = float(getattr(dr, m)[0])
                if m == "modal_anchor" and want < 0:  # the probe's -1 (no anchor at any step) is NaN in the table
                    want = float("nan")
                np.testing.assert_allclose(rows(got, metric=m).value, [want], atol=1e-6)
            if i == 0:
                k = rows(keys, item_id=iid, layer=layer, step=1).sort_values("key")
                np.testing.assert_allclose(k.received, sa.received[0, 1], atol=1e-6)
            dec = R.qk_at_layer(mdm, toks, layer, attention_mask=am)
            for m in ("norm_term", "angle_term", "anchor"):
                got_q = rows(q, item_id=iid, layer=layer, metric=m).sort_values("head").value
                np.testing.assert_allclose(got_q, getattr(dec, m)[0].double(), atol=1e-4)
    assert keys.item_id.unique().tolist() == [f"zoo-{SEED}-00000"]   # keep_keys=1: the first item only


def test_flow_retrieval_accuracy_rows_equal_the_probes_alone(mdm, data, mdm_tables):
    items = data[1]
    f = mdm_tables["flow"]
    ref = R.flow_for_items(mdm, items).to_frame()
    for i in range(len(items)):
        mine = rows(f, item_id=f"zoo-{SEED}-{i:05d}", metric="answer_density")
        want = ref[(ref["item"] == i) & (ref.metric == "answer_density")]
        assert mine.region.tolist() == want.region.tolist()
        np.testing.assert_allclose(mine.value, want.value, atol=1e-5)
    ret = retrieval.retrieval_scores(mdm, items, method="copy@commit")
    got = mdm_tables["retrieval"]
    assert ret.correct.tolist() == [False, True, True, False, True, False]
    for i in range(len(items)):
        g = rows(got, item_id=f"zoo-{SEED}-{i:05d}").sort_values(["layer", "head"]).value.to_numpy()
        np.testing.assert_allclose(g, ret.per_sample[i].reshape(-1).numpy(), atol=1e-12, equal_nan=True)
    acc = rows(mdm_tables["accuracy"], metric="acc", condition="with_context").value.tolist()
    assert acc == [float(c) for c in ret.correct.tolist()]
    s = mdm_tables["accuracy_summary"]
    gain = rows(s, condition="gain", metric="acc").iloc[0]["mean"]
    closed = rows(s, condition="no_context", metric="acc", group="overall").iloc[0]["mean"]
    assert gain == pytest.approx(float(ret.correct.double().mean()) - closed)


def test_knockout_rows_equal_the_probe_alone(mdm, data, tmp_path):
    tabs = sweep.run(mdm, data[0], "knockout", tmp_path / "k", limit=1, progress=False)
    item = data[1][0]
    res = patching.knockout(mdm, torch.tensor(ZT.encode(item.prompt)), answer=item.answer, n_random=2,
                            seed=sweep.item_seed(0, f"zoo-{SEED}-00000"), gen_length=4, n_steps=4)
    want = res.to_frame()
    got = tabs["knockout"]
    assert len(got) == len(want)
    np.testing.assert_allclose(got.value, want.value, atol=1e-9, equal_nan=True)
    assert (got.metric.tolist(), got.condition.tolist()) == (want.metric.tolist(), want.condition.tolist())


def test_causal_twin_batched_equals_alone(arm, data, tmp_path):
    tabs = sweep.run(arm, data[0], "absorption,temporal", tmp_path / "a", limit=3, batch_size=3, progress=False)
    for i, item in enumerate(data[1][:3]):
        ids, (toks, am, _) = alone(arm, item)
        res = R.absorption_by_layer(arm, toks, attention_mask=am)
        got = rows(tabs["absorption"], item_id=f"zoo-{SEED}-{i:05d}", mode="default", variant="pos0",
                   metric="absorption").sort_values("layer")
        np.testing.assert_allclose(got.value, res.per_sample[0, :, 0], atol=1e-4)
        out = arm.generate(ids, steps=4, gen_length=4, record=[ReceivedAttention()])
        sa = R.anchors_over_steps(out, layer=-1)
        got = rows(tabs["temporal"], item_id=f"zoo-{SEED}-{i:05d}", layer=arm.cfg.n_layers - 1)
        np.testing.assert_allclose(rows(got, metric="top1_mass").value, np.nanmax(sa.received[0].numpy(), -1),
                                   atol=1e-6)


def test_summary_is_mean_and_population_std(mdm_tables):
    df = rows(mdm_tables["absorption"], mode="default", variant="top1", metric="absorption", layer=2)
    s = rows(mdm_tables["absorption_summary"], mode="default", variant="top1", metric="absorption", layer=2)
    assert s.iloc[0]["mean"] == pytest.approx(df.value.mean())
    assert s.iloc[0]["std"] == pytest.approx(df.value.std(ddof=0)) and s.iloc[0]["n"] == 6


def test_batches_depend_on_lengths_only():
    # length: equal-length groups packed whole (first-fit decreasing); padded: sorted chunks
    assert sweep.make_batches([53, 53, 49, 54, 51, 51], 4, "length") == [[2, 3], [4, 5, 0, 1]]
    assert sweep.make_batches([53, 53, 49, 54, 51, 51], 4, "padded") == [[2, 4, 5, 0], [1, 3]]
    assert sweep.make_batches([5, 5, 5, 6], 2, "length") == [[0, 1], [2, 3]]
    for mode in sweep.runner.BATCHING:
        assert sweep.make_batches([5, 5, 5], 2, mode) == [[0, 1], [2]]
        lengths = [(7 * i) % 5 + 50 for i in range(23)]
        batches = sweep.make_batches(lengths, 4, mode)
        assert sorted(sum(batches, [])) == list(range(23)) and max(map(len, batches)) == 4
        assert all(b == sorted(b, key=lambda i: (lengths[i], i)) for b in batches)
    runs = sum(len({lengths[i] for i in b}) for b in sweep.make_batches(lengths, 4, "length"))
    assert runs == 5 + 3     # 5 lengths (sizes 5 5 5 4 4); each group of 5 must be cut once at batch_size 4
    with pytest.raises(ArgumentError, match="batching"):
        sweep.make_batches([5], 2, "sorted")


def test_length_batching_runs_equal_lengths_only(mdm, data):
    from mdm_lens.sweep import adapter as A

    from mdm_lens.sweep.items import read_items

    rendered = [TM.render(mdm, it, "zoo") for it in read_items(data[0]).items]   # lengths 50 53 53 51 55 50
    batch = A.make_batch(mdm, rendered, None, list(range(6)), list(range(6)))
    runs = A.sub_batches(mdm, batch, exact=True)
    assert [r.item_ids for r in runs] == [[f"zoo-{SEED}-{i:05d}" for i in g] for g in ([0, 5], [1, 2], [3], [4])]
    assert all(r.offsets == [0] * len(r.offsets) and bool(r.attention_mask.all()) for r in runs)
    assert [r.seeds for r in runs] == [[0, 5], [1, 2], [3], [4]] and [r.order for r in runs][0] == [0, 5]
    assert A.sub_batches(mdm, batch, exact=False) == [batch]


def test_padded_batches_equal_alone_to_rounding(mdm, data, tmp_path):
    tabs = sweep.run(mdm, data[0], "absorption,flow", tmp_path / "p", batching="padded", batch_size=6,
                     progress=False)
    for i, item in enumerate(data[1]):
        _, (toks, am, _) = alone(mdm, item)
        res = R.absorption_by_layer(mdm, toks, attention_mask=am)
        got = rows(tabs["absorption"], item_id=f"zoo-{SEED}-{i:05d}", mode="default", variant="anchors",
                   metric="absorption").sort_values("layer")
        np.testing.assert_allclose(got.value, res.per_sample[0, :, 2], atol=1e-4)


def test_knockout_rows_nan_at_a_step_say_why():
    # a step where every gold answer position is committed already (tf_* NaN by definition) or that committed nothing
    # (step_metric NaN): the row says why; rows with values and NaN summaries keep what they had
    import pandas as pd

    from mdm_lens.probes._knockout_notes import metric_notes

    df = pd.DataFrame({"metric": ["tf_answer_logprob", "tf_answer_rank", "step_metric", "step_metric", "effect"],
                       "step": pd.array([3, 3, 0, 1, pd.NA], dtype="Int64"),
                       "value": [float("nan"), float("nan"), float("nan"), 0.5, float("nan")], "note": [""] * 5})
    metric_notes(df, [])
    assert df["note"][0].startswith("no gold answer position is still masked") and df["note"][1] == df["note"][0]
    assert df["note"][2].startswith("this step committed no position")
    assert df["note"][3] == "" and df["note"][4] == ""
