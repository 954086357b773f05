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
