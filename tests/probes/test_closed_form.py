"""Closed-form numbers for every probe (issue #15) and the paper-mode edge cases of issue #11 §2.

Each case is built so the exact expected value follows from the definition (nulls at the right key,
default thresholds at their boundary, axis conventions), and is asserted exactly (or to float64
rounding), never as "larger than" or "finite".
"""

import math
import warnings

import numpy as np
import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.probes import drift as D
from mdm_lens.probes import floating as F
from mdm_lens.probes import flow as FL
from mdm_lens.probes import qk
from mdm_lens.probes import run as R

f64 = torch.float64


def H(n):
    return sum(1.0 / k for k in range(1, n + 1))


def idx(mask):
    return mask.nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------- §2 Rule C guard

def test_rule_c_flat_head_falls_back_to_top1_even_when_the_guard_trips():
    flat = torch.full((9,), 1 / 9, dtype=f64)
    assert idx(F.detect_anchors(flat, rule="paper_qk")) == [0]              # reference: [argmax] = [0]
    vis = torch.tensor([False, False] + [True] * 7)
    assert idx(F.detect_anchors(flat, rule="paper_qk", key_visible=vis)) == [2]   # first *visible* key
    assert idx(F.detect_anchors(flat, rule="paper_temporal")) == []          # Rule B has no fallback


def test_rule_c_guard_boundary_exactly():
    # std just below / above 1e-8 with the same two-spike shape: below -> [top-1], above -> both spikes
    base = torch.full((40,), 1e-3, dtype=f64)
    shape = torch.zeros(40, dtype=f64)
    shape[5], shape[9] = 1.0, 0.9
    unit = float((base + shape).std(unbiased=False))                     # std of the shape at scale 1
    for scale, want in ((0.99e-8 / unit, [5]), (1.01e-8 / unit, [5, 9])):
        c = base + scale * shape
        assert idx(F.detect_anchors(c, rule="paper_qk")) == want, scale


# ---------------------------------------------------------------------------------------------- §2 Rule B guard

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rule_b_ignores_one_ulp_differences_of_column_sums(dtype):
    c = torch.full((20,), 0.05, dtype=dtype)
    c[7] = torch.nextafter(c[7], torch.tensor(1.0, dtype=dtype))       # one ulp above its neighbours
    # without the relative guard this lone ulp has z = sqrt(19) > 3 and would be an anchor
    z = float((c[7].double() - c.double().mean()) / c.double().std(unbiased=False))
    assert z > 3
    assert idx(F.detect_anchors(c, rule="paper_temporal")) == []
    assert idx(F.detect_anchors(c, rule="paper_qk")) == [7]                # Rule C: guard trips -> argmax
    c[7] = 0.3
    assert idx(F.detect_anchors(c, rule="paper_temporal")) == [7]          # a real spike is still found


def test_rule_b_default_eps_is_3_at_its_boundary():
    # a lone spike among T equal keys has population z = sqrt(T - 1): T = 10 gives z = 3 exactly (strict
    # '>' -> not an anchor), T = 11 gives sqrt(10) = 3.16 (an anchor)
    for T, want in ((10, []), (11, [4])):
        c = torch.full((T,), 1.0, dtype=f64)
        c[4] = 2.0
        assert idx(F.detect_anchors(c, rule="paper_temporal")) == want, T
    c = torch.full((11,), 1.0, dtype=f64)
    c[4] = 2.0
    assert idx(F.detect_anchors(c, rule="paper_temporal", eps=3.2)) == []


def test_rule_c_default_eps_is_3_with_two_equal_spikes():
    # two equal spikes among T: z = sqrt((T - 2) / 2): T = 20 -> 3 exactly (fallback: first argmax),
    # T = 21 -> 3.08 (both)
    for T, want in ((20, [3]), (21, [3, 8])):
        c = torch.full((T,), 1.0, dtype=f64)
        c[3] = c[8] = 5.0
        assert idx(F.detect_anchors(c, rule="paper_qk")) == want, T


# ---------------------------------------------------------------------------------------------- other rules

def test_zscore_default_eps_3_and_floor_2():
    # 20 other keys alternate a +- 0.04 (leave-one-out mean a, std 0.04); the spike sits at a + 3.5 * 0.04
    # and holds 0.181 >= 2 / 21 of the mass
    a = (1 - 0.14) / 21
    c = torch.tensor([a + 0.04, a - 0.04] * 10 + [a + 0.14], dtype=f64)
    assert math.isclose(float(c.sum()), 1.0)
    assert idx(F.detect_anchors(c)) == [20]
    assert idx(F.detect_anchors(c, eps=3.6)) == []                       # z = 3.5
    assert idx(F.detect_anchors(c, floor=0.181 * 21 / 1.0 + 0.1)) == []  # floor above its mass share


def test_paper_absorption_rule_fires_on_column_sums_and_falls_back_on_means():
    alpha = torch.ones(20, dtype=f64)
    alpha[2], alpha[6] = 4.5, 4.4        # others' mean for key 6: (4.5 + 18) / 19 = 1.184 -> 4.4 > 4.184
    assert idx(F.detect_anchors(alpha, rule="paper_absorption")) == [2, 6]
    assert idx(F.detect_anchors(alpha, rule="paper_absorption", eps=3.5)) == [2]   # fallback: top-1 only
    assert idx(F.detect_anchors(alpha / alpha.sum(), rule="paper_absorption")) == [2]


def test_gu_and_rulli_default_thresholds():
    c = torch.tensor([0.31, 0.2, 0.2, 0.29], dtype=f64)
    assert idx(F.detect_anchors(c, rule="gu")) == [0]                   # 0.31 > 0.3
    c[0] = 0.29
    assert idx(F.detect_anchors(c, rule="gu")) == []
    alpha = torch.ones(20, dtype=f64)
    alpha[5] = 4.01                                                       # others' mean 1: > 1 + 3
    assert idx(F.detect_anchors(alpha, rule="rulli")) == [5]
    alpha[5] = 3.99
    assert idx(F.detect_anchors(alpha, rule="rulli")) == []
    assert idx(F.detect_anchors(torch.tensor([0.1, 0.5, 0.3, 0.1]), rule="topk", k=2)) == [1, 2]


# ---------------------------------------------------------------------------------------------- absorption + nulls

def test_uniform_null_numbers():
    assert math.isclose(F.uniform_null(4), 25.0)
    assert math.isclose(F.uniform_null(4, causal=True), 100 * (25 / 12) / 4)       # 52.083...
    assert math.isclose(F.uniform_null(4, causal=True, variant="top1"), 100 * (25 / 12) / 4)
    assert math.isclose(F.uniform_null(4, causal=True, positions=[3]), 100 * (1 / 4) / 4)
    assert math.isclose(F.uniform_null(4, causal=True, query_mask=[False, False, False, True]), 25.0)
    assert math.isclose(F.uniform_null(4, percent=False), 0.25)


def test_absorption_is_the_share_of_the_anchor_set():
    r = torch.tensor([0.5, 0.3, 0.2], dtype=f64)
    assert F.absorption(r, torch.tensor([False, True, False])).item() == pytest.approx(30.0, abs=1e-12)
    r2 = torch.tensor([1.0, 1.0, 2.0], dtype=f64)                          # not normalised: share of the total
    assert F.absorption(r2, torch.tensor([False, False, True])).item() == pytest.approx(50.0, abs=1e-12)


def test_causal_nulls_sit_at_the_first_visible_key_not_the_argmax():
    # left pad at key 0, 3 visible keys; uniform causal masses by rank: (H3 - H0)/3, (H3 - H1)/3, (H3 - H2)/3
    vis = torch.tensor([False, True, True, True])
    r = torch.tensor([0.0, 0.2, 0.1, 0.7], dtype=f64)                    # the argmax (key 3) is the LAST key
    res = F.absorption_variants(r, key_visible=vis, causal=True, anchors=torch.tensor([False, False, False, True]))
    u = [100 * (H(3) - H(k)) / 3 for k in range(3)]                        # 61.11, 27.78, 11.11
    assert res.pos0.item() == pytest.approx(20.0, abs=1e-12)               # first visible key = 1
    assert res.top1.item() == pytest.approx(70.0, abs=1e-12)
    assert res.null_pos0.item() == pytest.approx(u[0], abs=1e-12)
    assert res.null_top1.item() == pytest.approx(u[0], abs=1e-12)          # max_j u_j, not u at key 3
    assert res.null_anchors.item() == pytest.approx(u[2], abs=1e-12)       # the uniform mass on S = {3}
    assert res.excess_top1.item() == pytest.approx(70.0 - u[0], abs=1e-12)
    assert res.n_visible.item() == 3 and res.n_anchors.item() == 1
    bi = F.absorption_variants(r, key_visible=vis, causal=False, anchors=torch.tensor([False, False, False, True]))
    assert bi.null_pos0.item() == bi.null_top1.item() == bi.null_anchors.item() == pytest.approx(100 / 3)


def test_received_kinds_closed_form_on_a_causal_uniform_pattern():
    A = F.uniform_pattern(4, causal=True)
    mass = F.received_attention(A, causal=True)
    vis_k = F.received_attention(A, kind="visibility", causal=True)
    cum = F.received_attention(A, kind="cumulative", causal=True)
    assert torch.allclose(cum, torch.tensor([H(4), H(4) - 1, H(4) - 1.5, 0.25], dtype=f64))
    assert torch.allclose(mass, cum / 4)
    assert torch.allclose(vis_k, cum / torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=f64))
    # NaN at a padding column is ignored (never leaks into the used entries)
    A2 = F.uniform_pattern(4, key_visible=torch.tensor([True, True, True, False])).clone()
    A2[:, 3] = torch.nan
    m2 = F.received_attention(A2, key_visible=torch.tensor([True, True, True, False]))
    assert m2.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])


# ---------------------------------------------------------------------------------------------- drift / labels

def test_series_statistics_closed_form():
    x = torch.arange(4, dtype=f64)
    assert D.ols_slope(x, 2 * x + 1).item() == pytest.approx(2.0)
    assert D.spearman(x, -x ** 3).item() == pytest.approx(-1.0)
    p = torch.tensor([1.0, 0, 0, 0], dtype=f64)
    q = torch.tensor([0, 0, 0, 1.0], dtype=f64)
    assert D.wasserstein1(p, q).item() == 3.0
    assert D.wasserstein1(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])).item() == pytest.approx(1.0)


def test_initial_absorption_is_the_lower_median_over_steps():
    r = torch.zeros(3, 6, dtype=f64)
    r[:, :4] = torch.tensor([0.1, 0.2, 0.3])[:, None] / 4                # 10, 20, 30 % on the first 4 keys
    r[:, 4:] = (1 - r[:, :4].sum(-1, keepdim=True)) / 2
    assert D.initial_absorption(r).item() == pytest.approx(20.0)
    assert D.initial_absorption(r, n_initial=1).item() == pytest.approx(5.0)
    # left padding: the window is the first 4 *visible* keys
    vis = torch.tensor([False, True, True, True, True, True])
    assert D.initial_absorption(r, key_visible=vis).item() == pytest.approx(
        float(np.median((r[:, 1:5].sum(-1) / r[:, 1:].sum(-1) * 100).numpy())))


def _drift_with(stability_sets, K=6):
    a = torch.zeros(len(stability_sets), K, dtype=torch.bool)
    for s, S in enumerate(stability_sets):
        a[s, list(S)] = True
    return D.drift(a, torch.where(a, 0.4, 0.1).to(f64))


def test_classify_layer_default_thresholds_at_their_boundaries():
    ten = [{1}] * 9 + [{2}]                                                # pi = 0.9 exactly: "fixed"
    d = _drift_with(ten)
    assert D.classify_layer(d, torch.tensor(30.0)).labels.item() == "fixed_initial"   # >= 30 % exactly
    assert D.classify_layer(d, torch.tensor(29.9)).labels.item() == "fixed_anchor"
    assert D.classify_layer(_drift_with([{1}] * 8 + [{2}] * 2), torch.tensor(50.0)).labels.item() == "floating"
    half = [{4}] * 5 + [set()] * 5                                         # empty at 50 % of steps: diffuse
    assert D.classify_layer(_drift_with(half), torch.tensor(0.0)).labels.item() == "diffuse"
    more = [{4}] * 6 + [set()] * 4
    assert D.classify_layer(_drift_with(more), torch.tensor(0.0)).labels.item() == "other"   # pi 0.6, U = 1
    fixed4 = [{4}] * 10                                                    # j* = 4 is not initial
    assert D.classify_layer(_drift_with(fixed4), torch.tensor(90.0)).labels.item() == "fixed_anchor"


# ---------------------------------------------------------------------------------------------- qk

def test_kv_head_index_and_labels():
    assert qk.kv_head_index(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert qk.kv_head_index(8, 2, mode="paper").tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    lab = qk.qk_label(torch.tensor([0.8, 0.79, 0.1, -0.1, 0.5]), torch.tensor([0.2, 0.21, 0.9, 0.5, -0.6]))
    assert lab.tolist() == ["norm-driven", "combined", "angle-driven", "angle-driven", "no-advantage"]


def test_paper_qk_maps_without_query_states_under_gqa_pairs_k_h_mod_hkv_for_both():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 5, 2, 3, generator=g, dtype=f64)
    for h in range(4):                                                     # 4 query heads, 2 kv heads
        with pytest.warns(UserWarning, match="q := k"):
            m = qk.paper_qk_maps(None, k, head_avg=False, head=h)
        kh = k[0, :, h % 2]
        assert torch.allclose(m.qk[0], kh @ kh.T)
        n = kh.norm(dim=-1)
        assert torch.allclose(m.norm_prod[0], n[:, None] * n[None, :])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        avg = qk.paper_qk_maps(None, k)
        assert torch.allclose(avg.qk[0], k[0].mean(1) @ k[0].mean(1).T)
        assert torch.allclose(qk.paper_qk_maps(None, k, head_avg=False, head=-1, n_heads=4).qk,
                              qk.paper_qk_maps(None, k, head_avg=False, head=3).qk)


def test_cos_map_is_zero_for_a_zero_vector_as_the_reference():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 2, 3, generator=g, dtype=f64)
    k = torch.randn(1, 4, 1, 3, generator=g, dtype=f64)
    q[0, 1] = 0                                                            # a zero query row in both heads
    k[0, 2] = 0                                                            # a zero key
    for mode in ("paper", "default"):
        m = qk.paper_qk_maps(q, k, mode=mode, head_avg=False, head=0)
        assert not torch.isnan(m.cos).any()
        assert (m.cos[0, 1] == 0).all() and (m.cos[0, :, 2] == 0).all()
        qn, kn = q[0, :, 0].numpy(), k[0, :, 0].numpy()
        ref = (qn @ kn.T) / np.maximum(np.linalg.norm(qn, axis=1)[:, None] * np.linalg.norm(kn, axis=1)[None], 1e-12)
        assert np.allclose(m.cos[0].numpy(), ref, atol=1e-15)


# ---------------------------------------------------------------------------------------------- flow

def test_pool_and_paper_region_rollout_closed_form():
    # two layers of uniform bidirectional attention over T = 4; regions [0,1) bos, [1,4) doc
    A = F.uniform_pattern(4)[None].expand(2, 4, 4)
    regs = [FL.Region("bos", 0, 1, "bos"), FL.Region("doc", 1, 4, "doc")]
    P = FL.pool(A[0], regs)
    assert torch.allclose(P, torch.tensor([[0.25, 0.75], [0.25, 0.75]], dtype=f64))
    # token rollout of uniform U: ((U + I)/2)^2 = (3U + I)/4 ; pooled answer-free flow rows
    R2 = FL.rollout(A)[-1]
    U, I = A[0], torch.eye(4, dtype=f64)
    assert torch.allclose(R2, (3 * U + I) / 4)
    res = FL.flow(A, regs, warn=False)
    assert torch.allclose(res.flow, FL.pool((3 * U + I) / 4, regs))
    assert res.flow[0].tolist() == pytest.approx([(3 * 0.25 + 1) / 4, 3 * 0.75 / 4])


# ---------------------------------------------------------------------------------------------- run adapters

def _tiny(causal):
    cfg = MDMConfig(d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_mlp=32, d_vocab=30, n_ctx=32,
                    mask_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    attention="causal" if causal else "bidirectional")
    return HookedMDM.from_config(cfg, seed=0, init_std=0.2)


def _uniform_hooks(model):
    def flat(scores, hook):                                                # uniform attention over visible keys
        return torch.where(torch.isfinite(scores), torch.zeros_like(scores), scores)
    return [(f"blocks.{l}.attn.hook_attn_scores", flat) for l in range(model.cfg.n_layers)]


@pytest.mark.parametrize("causal", [False, True])
def test_absorption_by_layer_on_uniform_attention_equals_its_null(causal):
    model, T = _tiny(causal), 8
    tokens = torch.randint(5, 30, (2, T), generator=torch.Generator().manual_seed(0))
    null = 100 * H(T) / T if causal else 100 / T
    with model.hooks(fwd_hooks=_uniform_hooks(model)):
        res = R.absorption_by_layer(model, tokens)
        paper = R.absorption_by_layer(model, tokens, mode="paper", layers=[-1, 0])
    assert res.variants == ("pos0", "top1", "anchors") and res.layers == [0, 1, 2]
    assert torch.allclose(res.per_sample[..., 0], torch.full((2, 3), null, dtype=f64))
    assert torch.allclose(res.null[..., :2], torch.full((2, 3, 2), null, dtype=f64))
    assert torch.allclose(res.excess[..., :2], torch.zeros(2, 3, 2, dtype=f64), atol=1e-4)   # fp32 patterns
    assert (res.n_anchors == 0).all()                                       # uniform: zscore finds nothing
    assert paper.layers == [2, 0] and torch.allclose(paper.mean, torch.full((2, 1), null, dtype=f64))
    table = res.table()
    assert list(table.columns) == [f"{v}{s}" for v in ("pos0", "top1", "anchors")
                                   for s in ("", "_std", "_null", "_excess")]
    assert list(table.index) == [0, 1, 2]
    assert table["pos0"].tolist() == pytest.approx([null] * 3)
    assert table["pos0_null"].tolist() == pytest.approx([null] * 3)
    assert table["pos0_std"].tolist() == pytest.approx([0.0] * 3, abs=1e-4)
