"""Tests for mdm_lens.probes.flow (spec §1.e, §3.8): pooling invariants and the rollout artefacts."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens.probes import flow
from mdm_lens.probes.flow import BOSAbsorbingWarning, CharSpan, Region, RolloutCollapseWarning

SETTINGS = settings(max_examples=30, deadline=None)


def stochastic(shape, seed, causal=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(shape, generator=g, dtype=torch.float64) + 1e-3
    if causal:
        a = a.tril()
    return a / a.sum(-1, keepdim=True)


def rag_regions(T=30):
    return [Region("bos", 0, 1, "bos"), Region("query", 1, 5, "query"), Region("doc1", 5, 12, "doc"),
            Region("gold", 12, 18, "gold"), Region("doc3", 18, 26, "doc"), Region("answer", 26, T, "answer")]


def record(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, {x.category for x in w}


# ---------------------------------------------------------------------------------------------- regions

def test_complete_regions_fills_gaps_and_rejects_overlap():
    regs = flow.complete_regions([Region("q", 2, 5, "query"), Region("a", 7, 9, "answer")], 10)
    assert [(r.name, r.start, r.end, r.kind) for r in regs] == [
        ("other", 0, 2, "other"), ("q", 2, 5, "query"), ("other_2", 5, 7, "other"),
        ("a", 7, 9, "answer"), ("other_3", 9, 10, "other")]
    with pytest.raises(ValueError):
        flow.complete_regions([Region("a", 0, 4), Region("b", 3, 6)], 10)
    with pytest.raises(ValueError):
        Region("x", 0, 1, "passage")


def test_regions_from_char_spans_cover_every_token():
    text = "Q: who? [1] Paris is big. A: Paris"
    spans = [CharSpan("query", 0, 7, "query"), CharSpan("gold", 8, 25, "gold"), CharSpan("answer", 29, 34, "answer")]
    # a joint tokenisation's offsets: BOS special, word-ish pieces, one trailing pad
    pieces = [(0, 0), (0, 2), (2, 6), (6, 7), (7, 8), (8, 11), (11, 17), (17, 20), (20, 25), (25, 26),
              (26, 28), (28, 34), (0, 0)]
    pad = [False] * 12 + [True]
    regs = flow.regions_from_char_spans(spans, pieces, pad_mask=pad)
    got = [(r.name, r.start, r.end, r.kind) for r in regs]
    assert got == [("bos", 0, 1, "bos"), ("query", 1, 4, "query"), ("other", 4, 5, "other"),
                   ("gold", 5, 9, "gold"), ("other_2", 9, 11, "other"), ("answer", 11, 12, "answer"),
                   ("pad", 12, 13, "pad")]
    assert sum(len(r) for r in regs) == len(pieces)
    assert text[28:34] == " Paris"                                      # token 11 overlaps the answer most


def test_paper_region_shift_off_by_one():
    regs = rag_regions()
    shifted = flow.paper_region_shift(regs)
    assert [(r.start, r.end) for r in shifted] == [(0, 1), (1, 4), (4, 11), (11, 17), (17, 25), (26, 30)]


# ---------------------------------------------------------------------------------------------- pooling

@given(seed=st.integers(0, 10_000), T=st.integers(2, 24), data=st.data(), causal=st.booleans())
@SETTINGS
def test_pooled_rows_sum_to_one(seed, T, data, causal):
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), max_size=min(6, T - 1))))
    bounds = [0, *cuts, T]
    regs = [Region(f"r{i}", a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    A = stochastic((2, T, T), seed, causal)
    F = flow.pool(A, regs)
    assert torch.allclose(F.sum(-1), torch.ones(2, len(regs), dtype=torch.float64))
    L = data.draw(st.integers(1, 4))
    res = flow.flow(stochastic((L, T, T), seed + 1, causal), regs, causal=causal, warn=False)
    assert torch.allclose(res.flow.sum(-1), torch.ones(len(regs), dtype=torch.float64))
    assert torch.allclose(res.layer_flow.sum(-1), torch.ones(L, len(regs), dtype=torch.float64))


def test_rollout_definition():
    A = stochastic((3, 6, 6), 0)
    R = flow.rollout(A)
    eye = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(R[0], (A[0] + eye) / 2)
    assert torch.allclose(R[2], (A[2] + eye) / 2 @ (A[1] + eye) / 2 @ (A[0] + eye) / 2)
    assert torch.allclose(flow.rollout(A, residual=0.0)[-1], A[2] @ A[1] @ A[0])


# ---------------------------------------------------------------------------------------------- artefacts

@pytest.mark.parametrize("kind", ["uniform", "random"])
@pytest.mark.parametrize("mode", ["default", "paper"])
def test_causal_rollout_is_absorbed_by_bos(kind, mode):
    T, L = 30, 48
    if kind == "uniform":
        A = torch.tril(torch.ones(T, T, dtype=torch.float64))
        A = (A / A.sum(-1, keepdim=True)).expand(L, T, T)
    else:
        A = stochastic((L, T, T), 7, causal=True)
    res, caught = record(lambda: flow.flow(A, rag_regions(T), causal=True, mode=mode))
    assert res.bos_share.item() > 0.95
    assert res.answer_row[0].item() > 0.95                               # the Answer row is ~all BOS too
    assert bool(res.bos_absorbing) and BOSAbsorbingWarning in caught
    nb = res.answer_no_bos
    assert torch.isnan(nb[0]) and torch.isclose(nb[1:].sum(), torch.tensor(1.0, dtype=torch.float64))


def test_bidirectional_many_layers_collapse_to_rank_one():
    T, L = 30, 32
    res, caught = record(lambda: flow.flow(stochastic((L, T, T), 3), rag_regions(T)))
    assert res.row_spread.item() < 1e-4 and RolloutCollapseWarning in caught
    assert not bool(res.bos_absorbing) and BOSAbsorbingWarning not in caught
    # a single peaked layer keeps rows distinct: no warning
    peaked = (0.9 * torch.eye(T, dtype=torch.float64) + 0.1 / T)[None]
    one, caught1 = record(lambda: flow.flow(peaked, rag_regions(T)))
    assert one.row_spread.item() > 0.1 and RolloutCollapseWarning not in caught1


def planted_gold(T=30, L=2, gold=(12, 18), answer=(26, 30), share=0.6, seed=0):
    """Answer tokens put `share` of their attention on the gold doc; everything else is random."""
    A = stochastic((L, T, T), seed)
    g0, g1 = gold
    a0, a1 = answer
    rest = A[:, a0:a1].clone()
    rest[..., g0:g1] = 0
    rest = rest / rest.sum(-1, keepdim=True) * (1 - share)
    rest[..., g0:g1] = share / (g1 - g0)
    A[:, a0:a1] = rest
    return A


@pytest.mark.parametrize("mode", ["default", "paper"])
def test_gold_ratio_above_one_on_planted_case(mode):
    A = planted_gold()
    res = flow.flow(A, rag_regions(), mode=mode, warn=False)
    assert res.gold_ratio.item() > 1.5 and res.gold_ratio_density.item() > 1.5
    names = [r.name for r in res.regions]
    assert res.answer_row.argmax().item() == names.index("gold")
    # control: without the plant the gold doc is not special (density-normalised ratio ~ 1)
    ctrl = flow.flow(stochastic((2, 30, 30), 0), rag_regions(), mode=mode, warn=False)
    assert abs(ctrl.gold_ratio_density.item() - 1) < 0.2


def test_gold_ratio_with_two_gold_passages_is_the_mean_over_them():
    """Multi-hop items (HotpotQA, 2Wiki) have two gold passages: the ratio averages the gold regions' shares and
    divides by the mean distractor share (a sum over gold would double it)."""
    regs = [Region("bos", 0, 1, "bos"), Region("query", 1, 5, "query"), Region("gold1", 5, 12, "gold"),
            Region("doc2", 12, 18, "doc"), Region("gold3", 18, 26, "gold"), Region("answer", 26, 30, "answer")]
    res = flow.flow(stochastic((2, 30, 30), 3), regs, warn=False)
    row, dens = res.answer_row, res.answer_density
    assert torch.allclose(res.gold_ratio, (row[2] + row[4]) / 2 / row[3])
    assert torch.allclose(res.gold_ratio_density, (dens[2] + dens[4]) / 2 / dens[3])


def test_density_normalisation_removes_length_bias():
    # uniform bidirectional attention (no residual): raw shares ∝ length, densities all equal 1
    T = 30
    A = torch.full((1, T, T), 1.0 / T, dtype=torch.float64)
    res = flow.flow(A, rag_regions(T), residual=0.0, warn=False)
    sizes = torch.tensor([len(r) for r in res.regions], dtype=torch.float64)
    assert torch.allclose(res.answer_row, sizes / T)
    assert torch.allclose(res.answer_density, torch.ones(len(sizes), dtype=torch.float64))


def test_paper_mode_drops_unlisted_tokens_and_frames():
    T = 30
    regs = [r for r in rag_regions(T) if r.name != "query"] + [Region("tmpl", 1, 5, "template")]
    res = flow.flow(stochastic((2, T, T), 1), regs, mode="paper", warn=False)
    assert [r.name for r in res.regions] == ["bos", "doc1", "gold", "doc3", "answer"]
    assert res.notes and "dropped 4 tokens" in res.notes[0]
    assert torch.allclose(res.flow.sum(-1), torch.ones(5, dtype=torch.float64))
    default = flow.flow(stochastic((2, T, T), 1), regs, warn=False)
    assert "tmpl" in [r.name for r in default.regions]                   # nothing dropped by default
    df = default.to_frame()
    assert {"metric", "src", "dst", "layer", "value"} <= set(df.columns)
    assert set(df.loc[df.metric == "flow", "src"]) == {r.name for r in default.regions}
