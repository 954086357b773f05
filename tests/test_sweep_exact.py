"""The sweep's shared forwards and vectorised tables give exactly the numbers of the public probes: with
``--batching length`` every absorption / qk / flow / accuracy row is bit-identical to the probe called on
the item alone; ``qk_all_layers`` equals ``qk_at_layer`` per layer; temporal rows equal a row-by-row reading
of ``anchors_over_steps`` / ``drift_from_output`` on the same run; stale ``.done`` markers are not trusted."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from mdm_lens import ReceivedAttention, pattern_rows as PR
from mdm_lens import sweep
from mdm_lens.probes import run as R
from mdm_lens.sweep import adapter as A
from mdm_lens.sweep import shared as SH
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.store import SweepStore
from mdm_lens.sweep.summary import summarize
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT

SEED = 34   # prompt lengths 50 53 53 51 55 50; batch_size 4 → batches [0 5 1 2] [3 4] → runs [0 5] [1 2] [3] [4]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    return path, jsonl.export(path, 6, seed=SEED)


@pytest.fixture(scope="module")
def tables(mdm, data, tmp_path_factory):
    return sweep.run(mdm, data[0], "accuracy,absorption,qk,flow", tmp_path_factory.mktemp("s"), batch_size=4,
                     progress=False)


def _rows(df, **eq):
    for k, v in eq.items():
        df = df[df[k] == v]
    return df


def test_length_rows_equal_the_probes_alone_to_fp_rounding(mdm, data, tables):
    # The sweep's batched forward and the probe's single-item forward may pick different BLAS kernels for their
    # different batch shapes (5e-17 apart on some CPUs), so float rows agree to 1e-12, not bit for bit; counts,
    # labels and generated tokens stay exact.
    items = data[1]
    acc = tables["accuracy"]
    assert len(acc) == len(items) * 2 * 3 and not acc.duplicated(["item_id", "condition", "metric"]).any()
    flows = R.flow_for_items(mdm, items).to_frame()
    for i, item in enumerate(items):
        iid = f"zoo-{SEED}-{i:05d}"
        ids = torch.tensor(ZT.encode(item.prompt))
        toks, am, _ = R.generate_final(mdm, [ids])
        for mode in ("default", "paper"):
            res = R.absorption_by_layer(mdm, toks, attention_mask=am, mode=mode)
            got = _rows(tables["absorption"], item_id=iid, mode=mode)
            for metric, t in (("absorption", res.per_sample), ("null", res.null), ("excess", res.excess)):
                for vi, v in enumerate(res.variants):
                    g = _rows(got, metric=metric, variant=v).sort_values("layer").value.to_numpy()
                    np.testing.assert_allclose(g, t[0, :, vi].numpy(), rtol=0, atol=1e-12)
            g = _rows(got, metric="n_anchors").sort_values("layer").value.to_numpy()
            np.testing.assert_array_equal(g, res.n_anchors[0].numpy())
        for layer in range(mdm.cfg.n_layers):
            dec = R.qk_at_layer(mdm, toks, layer, attention_mask=am)
            q = _rows(tables["qk"], item_id=iid, layer=layer)
            for m in A.QK_METRICS:
                g = _rows(q, metric=m).sort_values("head")
                np.testing.assert_allclose(g.value.to_numpy(), getattr(dec, m)[0].double().numpy(), rtol=0,
                                           atol=1e-12)
                assert g.label.tolist() == list(dec.labels[0])
        mine = _rows(tables["flow"], item_id=iid)
        want = flows[flows["item"] == i]
        assert mine.metric.tolist() == want.metric.tolist() and mine.region.fillna("-").tolist() == \
            want.region.fillna("-").tolist()
        np.testing.assert_allclose(mine.value.to_numpy(), want.value.to_numpy(), rtol=0, atol=1e-12)
        pred = _rows(tables["accuracy"], item_id=iid, condition="with_context", metric="acc").prediction.iloc[0]
        assert pred == A._answer_text(mdm, toks[0, len(ids):].tolist())        # the same generation as alone
        nb = torch.tensor(TM.render(mdm, sweep.read_items(data[0]).items[i], "zoo", context=False).ids)
        closed, _, _ = R.generate_final(mdm, [nb])                               # closed-book units: alone too
        pred = _rows(tables["accuracy"], item_id=iid, condition="no_context", metric="acc").prediction.iloc[0]
        assert pred == A._answer_text(mdm, closed[0, len(nb):].tolist())


@pytest.mark.parametrize("which", ["mdm", "arm"])
def test_qk_all_layers_equals_qk_at_layer_bit_for_bit(which, mdm, arm):
    model = mdm if which == "mdm" else arm
    g = torch.Generator().manual_seed(3)
    x = torch.randint(5, 300, (4, 40), generator=g)
    am = torch.ones_like(x)
    am[1, :6], am[3, :2] = 0, 0
    for mask, setup in ((None, "plain"), (am, "plain"), (am, "chunks"), (am, "explicit")):
        if setup == "chunks":
            PR.set_query_chunk(model, 7)                  # several row chunks per layer
        if setup == "explicit":
            for b in model.blocks:
                b.attn.force_explicit = True
        try:
            got = SH.qk_all_layers(model, x, mask)
        finally:
            PR.set_query_chunk(model, None)
            for b in model.blocks:
                b.attn.force_explicit = False
        for layer in range(model.cfg.n_layers):
            if setup == "explicit":
                for b in model.blocks:
                    b.attn.force_explicit = True
            want = R.qk_at_layer(model, x, layer, attention_mask=mask)
            for b in model.blocks:
                b.attn.force_explicit = False
            for f in ("norm_term", "angle_term", "advantage", "key_norm_ratio", "key_norm_z", "cos_gap", "cos_z",
                      "value_norm_ratio", "anchor", "n_queries", "norm_term_mean"):
                torch.testing.assert_close(getattr(got[layer], f), getattr(want, f), rtol=0, atol=0, equal_nan=True)
            assert (got[layer].labels == want.labels).all()
    assert [b.attn.row_mode for b in model.blocks] == ["explicit"] * model.cfg.n_layers


def test_qk_all_layers_restores_the_model_when_a_layer_raises(mdm, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(R, "qk_from_activations", boom)
    with pytest.raises(RuntimeError, match="planted"):
        SH.qk_all_layers(mdm, torch.randint(5, 300, (2, 12)), None)
    assert [b.attn.row_mode for b in mdm.blocks] == ["explicit"] * mdm.cfg.n_layers
    assert not any(hp.fwd_hooks for hp in mdm.hook_dict.values())


def _temporal_reference(model, run, out, keep):
    """The row-by-row reading (the sweep's former loop): one dict per row."""
    rows, keys = [], []
    for layer in range(model.cfg.n_layers):
        sa = R.anchors_over_steps(out, layer=layer)
        drift = R.drift_from_output(out, layer=layer)
        top = sa.received.nan_to_num(-torch.inf).argmax(-1)
        mass = torch.nan_to_num(sa.received, nan=0.0)
        for b, item in enumerate(run.item_ids):
            off = run.offsets[b]
            for si, st in enumerate(sa.steps):
                an = sa.anchors[b, si]
                vals = dict(n_anchors=float(an.sum()), top1_key=float(top[b, si]) - off,
                            top1_mass=float(mass[b, si, top[b, si]]), anchor_mass=float(mass[b, si][an].sum()))
                rows += [(item, layer, st, k, v) for k, v in vals.items()]
            for m in A.DRIFT_METRICS:
                v = float(getattr(drift, m)[b])
                if m == "modal_anchor":  # the probe's -1 (no anchor at any step) is no position: NaN in the table
                    v = v - off if v >= 0 else float("nan")
                rows.append((item, layer, None, m, v))
            if keep[b]:
                labels = model.to_str_tokens(out.tokens[b, off:])
                for si, st in enumerate(sa.steps):
                    for k in range(off, sa.received.shape[-1]):
                        keys.append((item, layer, st, k - off, int(out.tokens[b, k]), labels[k - off],
                                     float(sa.received[b, si, k]), bool(sa.anchors[b, si, k]),
                                     int(out.trajectory.commit_step[b, k]), out.prompt_length - off))
    return rows, keys


@pytest.mark.parametrize("which", ["mdm", "arm"])
def test_temporal_rows_equal_the_row_by_row_reading(which, mdm, arm, data):
    model = mdm if which == "mdm" else arm
    rendered = [TM.render(model, it, "zoo") for it in sweep.read_items(data[0]).items]
    s = A.Settings(gen_length=4, steps=4, block_length=None, keep_keys=2)
    batch = A.make_batch(model, rendered, None, list(range(6)), list(range(6)))
    n_big = 0
    for run in A.sub_batches(model, batch, exact=True) + [batch]:         # equal-length runs, then a padded one
        out = A.generate(model, run.ids, run.attention_mask, s, 0, [ReceivedAttention()])
        keep = [o < 2 for o in run.order]
        got = A.temporal(model, run, s, {"out": out}, keep)
        rows, keys = _temporal_reference(model, run, out, keep)
        t = got["temporal"]
        assert list(zip(t.item_id, t.layer, t.step.astype(object).where(t.step.notna(), None), t.metric)) == \
            [r[:4] for r in rows]
        np.testing.assert_array_equal(t.value.to_numpy(), np.array([r[4] for r in rows]))
        k = got["temporal_keys"]
        pd.testing.assert_frame_equal(k, pd.DataFrame(keys, columns=A.KEY_COLUMNS), check_exact=True)
        n_big += sum(int((R.anchors_over_steps(out, layer=l).anchors.sum(-1) > 2).sum())
                     for l in range(model.cfg.n_layers))
    if which == "mdm":
        assert n_big > 0            # the > 2-anchor path of _anchor_mass is exercised


def test_anchor_mass_equals_the_indexed_sum_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    mass = torch.rand(64, 3, 97, generator=g, dtype=torch.float64) * torch.rand(64, 3, 1, generator=g,
                                                                                  dtype=torch.float64)
    k = torch.arange(64 * 3).reshape(64, 3) % 7                                  # 0 … 6 anchors per row
    anchors = torch.rand(64, 3, 97, generator=g).argsort(-1).argsort(-1) < k[..., None]
    want = torch.stack([torch.stack([mass[b, s][anchors[b, s]].sum() for s in range(3)]) for b in range(64)])
    assert torch.equal(A._anchor_mass(mass, anchors), want)


def test_padded_qk_anchor_is_relative_to_the_first_real_token(mdm, data, tmp_path):
    tabs = sweep.run(mdm, data[0], "qk", tmp_path / "p", batching="padded", batch_size=6, progress=False)
    for i, item in enumerate(data[1]):
        toks, am, _ = R.generate_final(mdm, [torch.tensor(ZT.encode(item.prompt))])
        for layer in range(mdm.cfg.n_layers):
            got = _rows(tabs["qk"], item_id=f"zoo-{SEED}-{i:05d}", layer=layer, metric="anchor").sort_values("head")
            want = R.qk_at_layer(mdm, toks, layer, attention_mask=am).anchor[0]
            assert got.value.tolist() == want.double().tolist()


def test_merge_from_memory_equals_merge_from_the_part_files(mdm, data, tmp_path):
    tabs = sweep.run(mdm, data[0], "accuracy,absorption,temporal,flow", tmp_path / "m", batch_size=4,
                     progress=False)
    items = sweep.read_items(data[0]).items
    store = SweepStore(tmp_path / "m")                    # a fresh store holds nothing: it reads every part
    lengths = [len(TM.render(mdm, it, "zoo").ids) for it in items]
    closed = [len(TM.render(mdm, it, "zoo", context=False).ids) for it in items]
    units = sweep.make_batches(lengths, 4, "length") + sweep.make_batches(closed, 4, "length")  # + closed-book units
    store.set_batches([[items[i].id for i in u] for u in units])
    assert store.done_batches() == set(range(len(units)))
    again = store.merge(list(range(len(units))), {it.id: i for i, it in enumerate(items)})
    assert set(again) == {"accuracy", "absorption", "temporal", "temporal_keys", "flow"}
    for name, df in again.items():
        pd.testing.assert_frame_equal(tabs[name], df, check_exact=True)
    for name, df in summarize(again).items():             # the summaries were made from the in-memory merge
        pd.testing.assert_frame_equal(tabs[f"{name}_summary"], df, check_exact=True)


def test_done_markers_of_other_batches_are_not_trusted(tmp_path):
    store = SweepStore(tmp_path)
    store.prepare({"a": 1}, force=False)
    store.write_batch(0, {"t": pd.DataFrame({"item_id": ["x", "y"], "v": [1.0, 2.0]})}, ["x", "y"])
    store.set_batches([["x", "y"], ["z"]])
    assert store.done_batches() == {0}
    store.set_batches([["x"], ["y", "z"]])      # a folder cut into other batches: batch 0 is recomputed
    assert store.done_batches() == set()
