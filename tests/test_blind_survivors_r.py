"""Blind list R (issue #32 §1): a test for each mutant that survived the whole suite, failing on that mutant."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import OutOfRangeError


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_committed_at_counts_negative_steps_from_the_end_and_refuses_past_the_run(tiny):
    # survivor committed-at-negative-step: committed_at(-1) matched nothing instead of the last step's commits
    out = tiny.generate([[5, 6, 7]], gen_length=4, steps=4)
    tr = out.trajectory
    last = tr.committed_at(-1)
    assert bool(last.any()) and torch.equal(last, tr.commit_step == tr.n_steps - 1)
    assert torch.equal(tr.committed_at(-tr.n_steps), tr.committed_at(0))
    assert int(sum(tr.committed_at(s).sum() for s in range(tr.n_steps))) == 4  # every canvas slot once
    for bad in (tr.n_steps, -tr.n_steps - 1):
        with pytest.raises(OutOfRangeError):
            tr.committed_at(bad)


@pytest.mark.parametrize("key", [[2, 2], [0, 1, 1], [3, -1]])
def test_nnsight_iter_refuses_a_step_listed_twice(tiny, key):
    # survivor nnsight-iter-duplicate-steps: [2, 2] is sorted but names one step twice (on 4 steps, -1 is 3)
    from mdm_lens.nnsight import DiffusionLM

    lm = DiffusionLM(tiny)
    with pytest.raises(OutOfRangeError, match="steps must increase"):
        with lm.generate(torch.tensor([[5, 6, 7]]), gen_length=4, steps=4) as tracer:
            for _ in tracer.iter[key]:
                pass


def test_to_frame_names_leading_axes_from_the_first_name():
    # survivor results-lead-dims-from-end: names were taken from the end of lead_dims (a field with fewer leading
    # axes than names got the last names; one with none got every name)
    from mdm_lens.probes import floating as F

    received = torch.rand(2, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = F.drift(F.detect_anchors(received), received)                 # leading shape (2,)
    f = d.to_frame(lead_dims=["batch", "layer"], metrics=["stability", "w1"])
    assert "batch" in f.columns and "layer" not in f.columns and sorted(f.batch.unique()) == [0, 1]
    one = F.drift(F.detect_anchors(received[0]), received[0])         # no leading axis
    g = one.to_frame(lead_dims=["batch"], metrics=["stability", "w1"])
    assert "batch" not in g.columns and list(g[g.metric == "w1"].pair) == [0, 1]


def test_explicit_patch_positions_skip_a_rows_padding(tiny):
    # survivor patching-positions-ignore-visibility: a pad position named in positions= was patched and counted
    from mdm_lens.probes import patching as PT

    pad = tiny.cfg.pad_token_id
    clean = torch.tensor([[pad, pad, 25, 26, 27], [28, 29, 30, 31, 32]])
    corrupt = torch.tensor([[pad, pad, 25, 40, 27], [28, 29, 30, 41, 32]])
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    r = PT.patch_anchor_activations(tiny, clean, corrupt, positions=[0, 3], attention_mask=am, gen_length=4,
                                    layers=[0])
    f = r.to_frame(metrics=["n_positions"]).set_index("condition").value
    assert f["positions"] == 1.5 == f["random"]  # row 0: position 3 only (0 is a pad); row 1: both


def test_the_sweeps_cache_probe_decodes_each_item_without_its_batch_padding(tmp_path, mdm):
    # survivor sweep-cache-padded-prompt: a short item's cached run took the batch's left pads as prompt tokens
    from mdm_lens import sweep
    from mdm_lens.zoo import jsonl

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 3, seed=0)
    one = sweep.run(mdm, data, "cache", tmp_path / "one", batch_size=1, progress=False)["cache"]
    padded = sweep.run(mdm, data, "cache", tmp_path / "pad", batch_size=3, batching="padded", progress=False)["cache"]
    lengths = {len(line) for line in data.read_text().splitlines()}
    assert len(lengths) > 1  # items of different lengths: the padded batch pads the shorter ones
    key = ["item_id", "kv_cache", "step", "block", "layer", "metric"]
    a, b = (t.sort_values(key).reset_index(drop=True) for t in (one, padded))
    assert a[key].equals(b[key])
    assert ((a.value - b.value).abs().fillna(0) <= 1e-6).all()


def test_knockout_effect_draws_each_conditions_own_error_bars():
    # survivor fig-knock-random-uses-anchor-err: the random bars showed the anchor condition's error bars
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.container import BarContainer

    from mdm_lens import views

    fig = views.knockout_effect([0, 1], [0.1, 0.2], [0.0, 0.1], anchor_err=[0.01, 0.02], random_err=[0.2, 0.3])
    anchor, random = [c for c in fig.axes[0].containers if isinstance(c, BarContainer)]
    for bars, want in ((anchor, [0.02, 0.04]), (random, [0.4, 0.6])):
        segments = bars.errorbar.lines[2][0].get_segments()
        assert np.allclose([abs(s[1][1] - s[0][1]) for s in segments], want)
    only = views.knockout_effect([0, 1], [0.1, 0.2], [0.0, 0.1], random_err=[0.2, 0.3])
    anchor, random = [c for c in only.axes[0].containers if isinstance(c, BarContainer)]
    assert anchor.errorbar is None and random.errorbar is not None
    plt.close("all")
