"""Planted-geometry tests for mdm_lens.probes.qk (spec §1.c, §3.6)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens.probes import qk

SETTINGS = settings(max_examples=30, deadline=None)
D = 16


def unit(v):
    return v / v.norm(dim=-1, keepdim=True)


def test_same_direction_larger_norm_is_purely_norm():
    g = torch.Generator().manual_seed(0)
    T, H, anchor = 10, 2, 4
    u = unit(torch.randn(D, generator=g, dtype=torch.float64))
    scales = 1 + torch.rand(T, generator=g, dtype=torch.float64)
    scales[anchor] = 6.0
    k = (scales[:, None] * u)[None, :, None, :].expand(1, T, H, D).clone()  # every key along u
    q = torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    q = q - (q @ u)[..., None] * u + 2.0 * u                             # q·u = 2 > 0 for every query
    res = qk.decompose(q, k, anchor)
    assert torch.allclose(res.angle_term, torch.zeros_like(res.angle_term), atol=1e-12)
    assert torch.all(res.norm_term > 0)
    assert torch.allclose(res.norm_share, torch.ones_like(res.norm_share))
    assert list(res.labels[0]) == ["norm-driven"] * H and res.labels_mean[0] == "norm-driven"
    assert torch.all(res.key_norm_ratio > 1)
    assert torch.allclose(res.cos_gap, torch.zeros_like(res.cos_gap), atol=1e-12)


def test_same_norm_aligned_with_queries_is_purely_angle():
    g = torch.Generator().manual_seed(1)
    T, H, anchor = 12, 3, 7
    direction = unit(torch.randn(D, generator=g, dtype=torch.float64))
    k = 3.0 * unit(torch.randn(1, T, H, D, generator=g, dtype=torch.float64))   # all keys norm 3
    k[0, anchor] = 3.0 * direction
    q = direction + 0.3 * torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    res = qk.decompose(q, k, anchor)
    assert torch.allclose(res.norm_term, torch.zeros_like(res.norm_term), atol=1e-12)
    assert torch.all(res.angle_term > 0)
    assert list(res.labels[0]) == ["angle-driven"] * H
    assert torch.allclose(res.key_norm_ratio, torch.ones_like(res.key_norm_ratio))
    assert torch.all(res.cos_gap > 0) and torch.all(res.cos_z > 0)


def test_small_key_norm_large_cos_is_angle_with_negative_norm_term():
    # Gu et al.'s ARM sink: smaller key norm, much larger cosine -> N < 0, label angle-driven
    g = torch.Generator().manual_seed(2)
    T, anchor = 10, 0
    direction = unit(torch.randn(D, generator=g, dtype=torch.float64))
    k = 4.0 * unit(torch.randn(1, T, 1, D, generator=g, dtype=torch.float64))
    k[0, anchor, 0] = 2.0 * direction
    q = (2 * direction + 0.2 * torch.randn(1, T, 1, D, generator=g, dtype=torch.float64))
    res = qk.decompose(q, k, anchor)
    assert res.norm_term.item() < 0 < res.advantage.item()
    assert res.labels[0, 0] == "angle-driven" and res.key_norm_ratio.item() < 1


def direct_advantage(q, k, anchor, key_visible, causal):
    """Mean over valid queries of mean_{j∈R_i} (q_i·k* − q_i·k_j)/√d, by explicit loops."""
    B, T, H, d = q.shape
    kk = k.repeat_interleave(H // k.shape[2], dim=2)
    out = torch.full((B, H), float("nan"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            per_query = []
            for i in range(T):
                if not key_visible[b, i]:
                    continue
                keys = [j for j in range(T) if key_visible[b, j] and (not causal or j <= i)]
                if anchor not in keys or len(keys) < 2:
                    continue
                s = q[b, i, h] @ kk[b, :, h].T / math.sqrt(d)
                per_query.append(torch.stack([s[anchor] - s[j] for j in keys if j != anchor]).mean())
            if per_query:
                out[b, h] = torch.stack(per_query).mean()
    return out


@given(seed=st.integers(0, 10_000), T=st.integers(3, 9), heads=st.sampled_from([(4, 4), (4, 2), (6, 2), (4, 1)]),
       causal=st.booleans(), pad=st.booleans())
@SETTINGS
def test_shapley_terms_sum_to_direct_advantage(seed, T, heads, causal, pad):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    q = torch.randn(2, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, T, Hkv, D, generator=g, dtype=torch.float64) * (0.5 + torch.rand(2, T, Hkv, 1, generator=g))
    vis = torch.ones(2, T, dtype=torch.bool)
    if pad:
        vis[1, -1] = False
    anchor = int(torch.randint(0, T - 1, (1,), generator=g))
    res = qk.decompose(q, k, anchor, key_visible=vis, causal=causal)
    ref = direct_advantage(q, k, anchor, vis, causal)
    assert torch.allclose(res.norm_term + res.angle_term, res.advantage)
    assert torch.allclose(res.advantage, ref, atol=1e-5, equal_nan=True)
    assert torch.allclose(res.advantage_mean, ref.mean(-1), atol=1e-5, equal_nan=True)


def test_gqa_mapping_matches_repeat_interleave():
    g = torch.Generator().manual_seed(3)
    for H, Hkv in [(28, 4), (32, 8), (8, 8), (6, 1)]:
        k = torch.randn(1, 5, Hkv, D, generator=g)
        rep = H // Hkv
        assert torch.equal(qk.expand_kv(k, H), k.repeat_interleave(rep, dim=2))
        assert torch.equal(qk.kv_head_index(H, Hkv), torch.arange(H) // rep)
        assert torch.equal(qk.kv_head_index(H, Hkv, mode="paper"), torch.arange(H) % Hkv)
    # Dream's 28/4: the AF pairing is wrong for most heads
    assert (qk.kv_head_index(28, 4) != qk.kv_head_index(28, 4, "paper")).sum() == 20   # 8 of 28 coincide
    with pytest.raises(ValueError):
        qk.kv_head_index(6, 4)


def test_value_norm_ratio_and_frame():
    g = torch.Generator().manual_seed(4)
    T, H = 6, 2
    q = torch.randn(1, T, H, D, generator=g)
    k = torch.randn(1, T, 1, D, generator=g)
    v = torch.ones(1, T, 1, D)
    v[0, 2] *= 0.25
    res = qk.decompose(q, k, torch.tensor([2]), v=v)
    assert torch.allclose(res.value_norm_ratio, torch.full((1, H), 0.25, dtype=torch.float64))
    df = res.to_frame()
    assert {"metric", "batch", "head", "value", "label"} <= set(df.columns)
    assert set(df.loc[df.metric == "labels", "label"]) <= set(qk.QK_LABELS)


def test_labels():
    n = torch.tensor([1.0, 0.5, -0.2, 0.9, 0.1, -1.0])
    g = torch.tensor([0.1, 0.5, 1.0, 0.0, 0.9, 0.5])
    assert list(qk.qk_label(n, g)) == ["norm-driven", "combined", "angle-driven", "norm-driven",
                                      "angle-driven", "no-advantage"]


def test_paper_maps_average_vectors_not_maps():
    g = torch.Generator().manual_seed(5)
    T, H, Hkv = 5, 4, 2
    q = torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, T, Hkv, D, generator=g, dtype=torch.float64)
    paper = qk.paper_qk_maps(q, k, head_avg=True, mode="paper")
    assert torch.allclose(paper.qk, q.mean(2) @ k.mean(2).transpose(-1, -2))       # no 1/√d
    assert torch.allclose(paper.cos * paper.norm_prod, paper.qk)
    per_head = torch.stack([qk.paper_qk_maps(q, k, head_avg=False, head=h, mode="default").qk for h in range(H)])
    default = qk.paper_qk_maps(q, k, head_avg=True, mode="default")
    assert torch.allclose(default.qk, per_head.mean(0))
    assert not torch.allclose(default.qk, paper.qk)                                 # the AF bug changes numbers
    # per-head paper pairing h % H_kv: head 1 uses kv 1 (default uses kv 0)
    p1 = qk.paper_qk_maps(q, k, head_avg=False, head=1, mode="paper")
    assert torch.allclose(p1.qk, q[:, :, 1] @ k[:, :, 1].transpose(-1, -2))
    causal = qk.paper_qk_maps(q, k, causal=True)
    assert torch.isnan(causal.qk[0, 0, 1]) and not torch.isnan(causal.qk[0, 1, 0])
    with pytest.warns(UserWarning):
        kk = qk.paper_qk_maps(None, k, mode="paper")
    assert torch.allclose(kk.qk, k.mean(2) @ k.mean(2).transpose(-1, -2))
    with pytest.raises(ValueError):
        qk.paper_qk_maps(None, k, mode="default")
