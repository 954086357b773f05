"""Planted-phenomenon tests for mdm_lens.probes.floating (spec §1.a, §3.1-§3.5)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens.errors import NonFiniteError
from mdm_lens.probes import floating as F

SETTINGS = settings(max_examples=30, deadline=None)


def harmonic(n: int) -> float:
    return sum(1.0 / k for k in range(1, n + 1))


def random_stochastic(shape, seed, concentration=1.0, causal=False):
    """Rows ~ Dirichlet(concentration) (small concentration = peaky rows), optionally causal."""
    torch.manual_seed(seed)
    a = torch.distributions.Gamma(torch.tensor(float(concentration)), torch.tensor(1.0)).sample(shape)
    a = a.to(torch.float64).clamp_min(1e-30)
    if causal:
        a = a.tril()
    return a / a.sum(-1, keepdim=True)


def spike_pattern(T, cols, share, seed=0):
    """Rows put `share` on each planted column and spread the rest (noisily) over the others."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.rand(T, T, generator=g, dtype=torch.float64) + 1.0
    rest[:, cols] = 0
    rest = rest / rest.sum(-1, keepdim=True) * (1 - share * len(cols))
    rest[:, cols] = share
    return rest


# ---------------------------------------------------------------------------------------------- received

def test_received_kinds_bidirectional_and_causal():
    T = 7
    a = random_stochastic((2, T, T), seed=1)
    m = F.received_attention(a, kind="mass")
    assert torch.allclose(m, a.mean(-2))
    assert torch.allclose(m.sum(-1), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(F.received_attention(a, kind="cumulative"), a.sum(-2))
    assert torch.allclose(F.received_attention(a, kind="visibility"), m)   # bidirectional: r = m
    c = random_stochastic((T, T), seed=2, causal=True)
    r = F.received_attention(c, kind="visibility", causal=True)
    gu = torch.stack([c[j:, j].mean() for j in range(T)])                  # Gu's α_j = mean_{i≥j} A_ij
    assert torch.allclose(r, gu)


def test_received_padding_and_query_mask():
    T = 6
    a = torch.full((T, T), 1.0 / T, dtype=torch.float64)                   # unmasked: leaks onto pads
    vis = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    m = F.received_attention(a, key_visible=vis)
    assert torch.all(m[~vis] == 0)
    assert torch.allclose(m[vis], torch.full((4,), 1.0 / T, dtype=torch.float64))  # mean over the 4 real rows
    qm = torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.bool)
    one_hot_row = torch.eye(T, dtype=torch.float64)[[3] * T]
    assert F.received_attention(one_hot_row, query_mask=qm)[3] == 1.0


def test_align_mask():
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert F.align_mask(mask, 5, batch_dim=1).shape == (1, 3, 1, 1, 5)
    assert F.align_mask(mask, 2).shape == (3, 5)


def test_uniform_received_closed_form_matches_explicit_matrix():
    vis = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for causal in (False, True):
        u = F.uniform_pattern(7, causal, key_visible=vis)
        for kind in ("mass", "visibility", "cumulative"):
            explicit = F.received_attention(u, key_visible=vis, kind=kind, causal=causal)
            assert torch.allclose(F.uniform_received(vis, causal, kind), explicit), (causal, kind)


# ---------------------------------------------------------------------------------------------- anchors

def test_zscore_finds_exactly_the_planted_spike():
    T = 40
    m = F.received_attention(spike_pattern(T, [17], share=0.2))
    a = F.detect_anchors(m)
    assert a.nonzero().flatten().tolist() == [17]
    assert F.detect_anchors(m, rule="paper_temporal").nonzero().flatten().tolist() == [17]  # agrees with B


@given(T=st.integers(2, 60), causal=st.booleans())
@SETTINGS
def test_uniform_attention_has_no_anchors_and_top1_equals_null(T, causal):
    m = F.received_attention(F.uniform_pattern(T, causal))
    assert not F.detect_anchors(m, causal=causal).any()
    res = F.absorption_variants(m, causal=causal)
    expected = 100 * (harmonic(T) / T if causal else 1.0 / T)
    assert res.n_anchors.item() == 0 and res.anchors.item() == 0
    assert math.isclose(res.top1.item(), expected, rel_tol=1e-12)
    assert math.isclose(res.null_top1.item(), expected, rel_tol=1e-12)
    assert abs(res.excess_top1.item()) < 1e-9 and abs(res.excess_pos0.item()) < 1e-9


@given(T=st.integers(1, 200))
@SETTINGS
def test_causal_uniform_pos0_absorption_is_harmonic(T):
    m = F.received_attention(F.uniform_pattern(T, causal=True))
    pos0 = F.absorption(m, torch.arange(T) == 0).item()
    assert math.isclose(pos0, 100 * harmonic(T) / T, rel_tol=1e-12)
    assert math.isclose(F.uniform_null(T, causal=True, variant="pos0"), 100 * harmonic(T) / T, rel_tol=1e-12)
    assert math.isclose(F.uniform_null(T, causal=True, variant="top1"), 100 * harmonic(T) / T, rel_tol=1e-12)
    assert math.isclose(F.uniform_null(T, causal=False, variant="top1"), 100 / T, rel_tol=1e-12)


def test_uniform_null_query_subset():
    # only the last row as query: uniform causal last row is 1/T everywhere
    T = 10
    qm = torch.arange(T) == T - 1
    assert math.isclose(F.uniform_null(T, True, "pos0", query_mask=qm), 10.0)
    # only row 0: all of it on column 0
    assert math.isclose(F.uniform_null(T, True, "pos0", query_mask=torch.arange(T) == 0), 100.0)


def test_spec_null_values():
    # §1.a: causal column-0 null = 12.7% at T=32, 9.0% at T=50, 6.0% at T=84, 2.9% at T=200
    for T, pct in [(32, 12.7), (50, 9.0), (84, 6.0), (200, 2.9)]:
        assert round(F.uniform_null(T, causal=True), 1) == pct


@given(T=st.integers(2, 50), seed=st.integers(0, 10_000), conc=st.sampled_from([0.05, 0.3, 1.0, 5.0]),
       causal=st.booleans())
@SETTINGS
def test_rule_a_is_always_top1(T, seed, conc, causal):
    a = random_stochastic((3, T, T), seed=seed, concentration=conc, causal=causal)
    m = F.received_attention(a)
    s = F.detect_anchors(m, rule="paper_absorption")
    assert torch.all(s.sum(-1) == 1)                                       # num_sinks ≡ 1
    assert torch.equal(s.float().argmax(-1), m.argmax(-1))
    assert torch.allclose(F.absorption(m, s), 100 * m.amax(-1))


@given(T=st.integers(1, 40), seed=st.integers(0, 10_000), rule=st.sampled_from(F.RULES))
@SETTINGS
def test_absorption_in_range_and_invisible_never_anchor(T, seed, rule):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(2, T, generator=g, dtype=torch.float64) ** 4
    vis = torch.rand(2, T, generator=g) > 0.3
    s = F.detect_anchors(m, rule=rule, key_visible=vis, **(dict(k=min(3, T)) if rule == "topk" else {}))
    assert not (s & ~vis).any()
    ab = F.absorption(m, s)
    assert torch.all((ab >= 0) & (ab <= 100 + 1e-9))
    rand_anchor = torch.rand(2, T, generator=g) > 0.5
    ab2 = F.absorption(m, rand_anchor)
    assert torch.all((ab2 >= 0) & (ab2 <= 100 + 1e-9))


def test_two_similar_spikes_leave_one_out_beats_rule_b():
    # k equal spikes among T keys: Rule B z = sqrt((T-k)/k); leave-one-out z = sqrt((T-k)/(k-1)).
    # T=12, k=2: B z ≈ 2.24 < 3 (both masked), LOO z ≈ 3.16 > 3 (both found).
    T = 12
    m = torch.full((T,), 0.04, dtype=torch.float64)
    m[3], m[8] = 0.30, 0.29
    m = m / m.sum()
    assert F.detect_anchors(m).nonzero().flatten().tolist() == [3, 8]
    assert not F.detect_anchors(m, rule="paper_temporal").any()
    assert F.detect_anchors(m, rule="paper_qk").nonzero().flatten().tolist() == [3]   # C: top-1 fallback
    # and from a full attention pattern
    p = spike_pattern(T, [3, 8], share=0.3)
    r = F.received_attention(p)
    assert F.detect_anchors(r).nonzero().flatten().tolist() == [3, 8]
    assert not F.detect_anchors(r, rule="paper_temporal").any()


def test_rule_c_flat_gives_the_top1_fallback_and_zscore_floor():
    # the reference skips the 3-sigma test when std <= 1e-8 but still falls back to argmax: [0], not []
    flat = torch.full((9,), 1 / 9, dtype=torch.float64)
    assert F.detect_anchors(flat, rule="paper_qk").nonzero().flatten().tolist() == [0]
    assert not F.detect_anchors(flat, rule="paper_temporal").any()
    # a clear outlier in z but below the mass floor 2/|V| is not an anchor
    m = torch.full((100,), 1.0, dtype=torch.float64)
    m[5] = 1.5
    assert not F.detect_anchors(m / m.sum()).any()
    assert F.detect_anchors(m / m.sum(), floor=1.0).nonzero().flatten().tolist() == [5]


def test_gu_rulli_topk():
    m = torch.tensor([0.35, 0.3, 0.2, 0.15], dtype=torch.float64)
    assert F.detect_anchors(m, rule="gu").tolist() == [True, False, False, False]
    assert not F.detect_anchors(m, rule="gu", eps=0.4).any()
    vis = torch.tensor([False, True, True, True])                           # left padding: first visible key
    assert F.detect_anchors(m, rule="gu", key_visible=vis).nonzero().flatten().tolist() == []
    assert F.detect_anchors(m, rule="gu", key_visible=vis, eps=0.25).nonzero().flatten().tolist() == [1]
    assert F.detect_anchors(m, rule="topk", k=2).nonzero().flatten().tolist() == [0, 1]
    # Rulli on cumulative α (mean 1): key 2 gets 6 queries' worth among T = 20
    T = 20
    p = spike_pattern(T, [2], share=6 / T)
    alpha = F.received_attention(p, kind="cumulative")
    assert F.detect_anchors(alpha, rule="rulli").nonzero().flatten().tolist() == [2]
    assert not F.detect_anchors(F.received_attention(p), rule="rulli").any()    # never on column means


def test_absorption_variants_with_padding_and_given_anchors():
    vis = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    m = F.uniform_received(vis, causal=True)
    res = F.absorption_variants(m, key_visible=vis, causal=True, anchors=torch.arange(8) == 1)
    assert math.isclose(res.pos0.item(), 100 * harmonic(5) / 5)
    assert math.isclose(res.null_anchors.item(), 100 * (harmonic(5) - 1) / 5)
    assert abs(res.excess_anchors.item()) < 1e-12 and res.n_visible.item() == 5
    df = res.to_frame()
    assert set(df.metric) >= {"pos0", "top1", "anchors", "null_top1", "excess_anchors"}


# ---------------------------------------------------------------------------------------------- drift

def anchors_from_sets(sets, K):
    a = torch.zeros(len(sets), K, dtype=torch.bool)
    for s, S in enumerate(sets):
        a[s, list(S)] = True
    return a


def test_drift_hand_built_sequence():
    K = 8
    sets = [{1}, {1, 3}, {3}, {5}, set(), set()]
    a = anchors_from_sets(sets, K)
    r = torch.full((len(sets), K), 0.01, dtype=torch.float64)
    r[a] = 0.3                                                           # equal mass on the anchors
    r[4, 6] = r[5, 6] = 0.5                                              # top-1 at 6 on empty steps
    d = F.drift(a, r)
    # steps 4 and 5 both have no anchors: their Jaccard is 0/0, NaN, and left out of the mean (not a fake 1.0)
    assert torch.allclose(d.jaccard, torch.tensor([0.5, 0.5, 0.0, 0.0, math.nan], dtype=torch.float64),
                          equal_nan=True)
    assert math.isclose(d.mean_jaccard.item(), 0.25) and math.isclose(d.drift_index.item(), 0.75)
    never = F.drift(torch.zeros(3, K, dtype=torch.bool), r[:3])
    assert torch.isnan(never.jaccard).all() and math.isnan(never.mean_jaccard.item())
    assert torch.allclose(d.persistence[[1, 3, 5]], torch.tensor([2 / 6, 2 / 6, 1 / 6], dtype=torch.float64))
    assert d.modal_anchor.item() == 1 and math.isclose(d.stability.item(), 2 / 6)
    assert d.n_distinct.item() == 3 and math.isclose(d.empty_fraction.item(), 2 / 6)
    assert d.n_anchors.tolist() == [1, 2, 1, 1, 0, 0]
    c = d.centroid
    assert c[:4].tolist() == [1.0, 2.0, 3.0, 5.0] and torch.isnan(c[4:]).all()
    assert math.isclose(d.centroid_slope.item(), 1.3)                    # OLS of (0,1,2,3) on (1,2,3,5)
    assert math.isclose(d.centroid_spearman.item(), 1.0)
    # top-1: 1, (1 or 3: tie -> first, 1), 3, 5, 6, 6 -> changes at 3 of 5 transitions
    assert d.top1.tolist() == [1, 1, 3, 5, 6, 6] and math.isclose(d.top1_change_rate.item(), 3 / 5)
    df = d.to_frame()
    assert {"metric", "key", "step", "pair", "value"} <= set(df.columns)
    assert (df.metric == "persistence").sum() == K


def test_drift_w1_and_weighted_centroid_and_batching():
    K = 6
    r = torch.zeros(3, K, dtype=torch.float64)
    r[0, 1], r[1, 3], r[2, 3] = 1, 1, 1
    a = r > 0
    d = F.drift(a, r)
    assert d.w1.tolist() == [2.0, 0.0]                                    # a point mass moves 2 tokens
    r2 = torch.tensor([[0, 0.3, 0, 0.1, 0, 0]], dtype=torch.float64)
    d2 = F.drift(r2 > 0, r2)
    assert math.isclose(d2.centroid.item(), (0.3 * 1 + 0.1 * 3) / 0.4)
    # leading dims: a stack of series equals the series processed one by one
    g = torch.Generator().manual_seed(0)
    R = torch.rand(2, 3, 5, K, generator=g, dtype=torch.float64)
    A = R > 0.7
    big = F.drift(A, R)
    one = F.drift(A[1, 2], R[1, 2])
    for name in ("mean_jaccard", "centroid_slope", "n_distinct", "mean_w1", "stability"):
        x, y = getattr(big, name)[1, 2], getattr(one, name)
        assert torch.allclose(x.double(), y.double(), equal_nan=True), name


@given(n=st.integers(2, 12), seed=st.integers(0, 10_000))
@SETTINGS
def test_spearman_and_slope_match_reference(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 4, n).astype(float)                              # ties on purpose
    y = rng.normal(size=n)
    y[rng.random(n) < 0.2] = np.nan
    ok = ~np.isnan(y)
    xs, ys = pd.Series(x[ok]), pd.Series(y[ok])
    if not ok.all():
        with pytest.raises(NonFiniteError):
            F.spearman(torch.tensor(x), torch.tensor(y))
    ours = F.spearman(torch.tensor(x), torch.tensor(y), nan_policy="omit").item()
    if ok.sum() < 2 or xs.nunique() < 2 or ys.nunique() < 2:
        assert math.isnan(ours)
    else:
        ref = np.corrcoef(xs.rank(), ys.rank())[0, 1]
        assert math.isclose(ours, ref, abs_tol=1e-9)
        slope = np.polyfit(x[ok], y[ok], 1)[0]
        assert math.isclose(F.ols_slope(torch.tensor(x), torch.tensor(y), nan_policy="omit").item(), slope, abs_tol=1e-8)


def test_anchor_types():
    # keys 0-1 prompt; key 2 committed at step 0, key 3 at step 1, key 4 at step 2, key 5 at step 3
    commit = torch.tensor([-1, -1, 0, 1, 2, 3])
    a = torch.ones(3, 6, dtype=torch.bool)
    t = F.drift(a, torch.ones(3, 6), commit_step=commit).anchor_types     # [step, type]
    # step 0: prompt 2, masked 4 | step 1: just(2) | step 2: committed(2), just(3), masked(4,5)
    assert t.tolist() == [[2, 0, 0, 4], [2, 0, 1, 3], [2, 1, 1, 2]]


# ---------------------------------------------------------------------------------------------- layers

def test_classify_layer():
    S, K = 10, 40
    series = torch.zeros(5, S, K, dtype=torch.bool)
    series[0, :, 0] = True                                                # fixed initial
    series[1, :, 7] = True                                                # fixed non-initial
    for s in range(S):
        series[2, s, 4 + s // 3] = True                                   # drifting anchor
    series[3, :2, 3] = True                                               # mostly empty
    series[4, :, 1] = True                                                # initial, but little mass
    r = torch.full((5, S, K), 0.02, dtype=torch.float64)
    r[series] = 0.6
    r[4, :, 1] = 0.1
    r = r / r.sum(-1, keepdim=True)
    d = F.drift(series, r)
    init = F.initial_absorption(r)
    lab = F.classify_layer(d, init)
    assert list(lab.labels) == ["fixed_initial", "fixed_anchor", "floating", "diffuse", "fixed_anchor"]
    stacked = F.classify_layer(F.drift(series[[0, 0, 2]], r[[0, 0, 2]]), init[[0, 0, 2]])
    assert stacked.majority(axis=0) == "fixed_initial"
    assert stacked.distribution(axis=0).tolist() == [2, 0, 1, 0, 0]
    assert "label" in lab.to_frame().columns


def test_zscore_default_threshold_is_three_leave_one_out_sigmas():
    # key 0 against the others [1, 2, 1, 2]: mean 1.5, population std 0.5, so the default ε = 3 puts the
    # threshold at exactly 3.0; 2.75 clears ε = 2 (2.5) but not the default, 3.05 clears the default
    from mdm_lens.probes.floating import detect_anchors

    below = torch.tensor([2.75, 1, 2, 1, 2], dtype=torch.float64)
    above = torch.tensor([3.05, 1, 2, 1, 2], dtype=torch.float64)
    assert detect_anchors(below).tolist() == [False] * 5
    assert detect_anchors(below, eps=2.0).tolist() == [True, False, False, False, False]
    assert detect_anchors(above).tolist() == [True, False, False, False, False]


# ---------------------------------------------------------------------------------------------- Rule B guard

def reference_rule_b(c: torch.Tensor) -> list[int]:
    """The paper's Rule B as its code computes it, in the array's own dtype and with no guard at all."""
    a = c.numpy()
    return np.nonzero(a > a.mean() + 3 * a.std())[0].tolist()


def reference_rule_c(c: torch.Tensor) -> list[int]:
    """Rule C (QK_decomposition.py): the 3-sigma test unless np.isclose(std, 0), then the argmax fallback."""
    a = c.numpy()
    found = [] if np.isclose(a.std(), 0.0) else np.nonzero(a > a.mean() + 3 * a.std())[0].tolist()
    return found or [int(a.argmax())]


@pytest.mark.parametrize("dtype,gap", [(torch.float64, 1e-6), (torch.float64, 1e-9), (torch.float32, 1e-4),
                                       (torch.float32, 1e-5)])
def test_rule_b_matches_the_reference_on_spikes_the_dtype_resolves(dtype, gap):
    T, spikes = 64, [10, 40]
    c = torch.ones(T, dtype=dtype)
    c[spikes] = 1.0 + gap                                                 # two spikes just above a flat row
    assert reference_rule_b(c) == spikes
    assert F.detect_anchors(c, rule="paper_temporal").nonzero().flatten().tolist() == spikes
    assert F.detect_anchors(c, rule="paper_qk").nonzero().flatten().tolist() == reference_rule_c(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rule_b_guard_is_a_few_ulps_of_the_input_dtype(dtype):
    T, spikes = 64, [10, 40]
    c = torch.ones(T, dtype=dtype)
    ulp = torch.finfo(dtype).eps
    c[spikes] = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype))
    assert F.detect_anchors(c, rule="paper_temporal").nonzero().flatten().tolist() == []  # 1 ulp: summation noise
    c[spikes] = 1.0 + 64 * ulp                                                            # 64 ulps: resolved
    assert F.detect_anchors(c, rule="paper_temporal").nonzero().flatten().tolist() == spikes
    assert F.RULE_B_ULPS == 8
