"""Property-based argument tests (issue #11 §3): every public probe, driven with random *valid* arguments,
never raises; with one argument made invalid (out of range, wrong type, wrong shape, NaN), it always
raises the typed error (``mdm_lens.errors``) whose ``argument`` names the culprit.
"""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention
from mdm_lens.errors import ArgumentError, ArgumentTypeError, NonFiniteError, OutOfRangeError
from mdm_lens.probes import drift as D
from mdm_lens.probes import floating as F
from mdm_lens.probes import flow as FL
from mdm_lens.probes import qk
from mdm_lens.probes import retrieval as RT
from mdm_lens.probes import run as R

FAST = settings(max_examples=25, deadline=None)
MODEL = settings(max_examples=8, deadline=None)
f64 = torch.float64


def expect(err, argument, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises `err` whose .argument starts with `argument` and whose message names it."""
    with pytest.raises(err) as info:
        fn(*args, **kwargs)
    got = info.value.argument or ""
    assert got.split("[")[0] == argument.split("[")[0], (got, argument, str(info.value))
    assert argument.split("[")[0] in str(info.value)


@st.composite
def series(draw, min_T=1, max_T=10):
    """(received [lead..., T] in [0, 1), key_visible of the same shape, rng seed)."""
    T = draw(st.integers(min_T, max_T))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    r = torch.rand(*lead, T, generator=g, dtype=f64) ** 3
    vis = torch.rand(*lead, T, generator=g) > 0.3
    return r, vis, T


# ---------------------------------------------------------------------------------------------- floating

@given(case=series(), rule=st.sampled_from(F.RULES), eps=st.none() | st.floats(0, 5), floor=st.floats(0, 3),
       use_vis=st.booleans(), causal=st.booleans(), kind=st.sampled_from(F.KINDS), data=st.data())
@FAST
def test_detect_anchors_valid(case, rule, eps, floor, use_vis, causal, kind, data):
    r, vis, T = case
    k = data.draw(st.integers(1, T))
    # each rule gets only the arguments it reads (another rule's argument is refused: test_misuse_round7c)
    reads = dict(eps=eps) if rule != "topk" else dict(k=k)
    if rule == "zscore":
        reads.update(floor=floor, kind=kind)
    out = F.detect_anchors(r, rule=rule, key_visible=vis if use_vis else None, causal=causal, **reads)
    assert out.dtype == torch.bool and out.shape == r.shape
    if use_vis:
        assert not (out & ~vis).any()
    res = F.absorption_variants(r, key_visible=vis if use_vis else None, causal=causal, anchors=out)
    assert res.pos0.shape == r.shape[:-1]


DETECT_BAD = {
    "rule": (dict(rule="z-score"), ArgumentError, "rule"),
    "eps_negative": (dict(eps=-0.5), ArgumentError, "eps"),
    "eps_nan": (dict(eps=float("nan")), ArgumentError, "eps"),
    "eps_str": (dict(eps="3"), ArgumentTypeError, "eps"),
    "floor": (dict(floor=-1), ArgumentError, "floor"),
    "k_zero": (dict(rule="topk", k=0), ArgumentError, "k"),
    "k_big": (dict(rule="topk", k=10_000), ArgumentError, "k"),
    "k_float": (dict(k=1.5), ArgumentTypeError, "k"),
    "kind": (dict(kind="sum"), ArgumentError, "kind"),
    "causal": (dict(causal=1), ArgumentTypeError, "causal"),
    "nan_policy": (dict(nan_policy="ignore"), ArgumentError, "nan_policy"),
}


@given(case=series(), bad=st.sampled_from(sorted(DETECT_BAD)))
@FAST
def test_detect_anchors_invalid(case, bad):
    r, vis, T = case
    kwargs, err, name = DETECT_BAD[bad]
    expect(err, name, F.detect_anchors, r, **kwargs)


@given(case=series(), which=st.sampled_from(["nan", "inf", "shape", "dtype", "int", "mask_float"]),
       fn=st.sampled_from(["detect", "variants", "absorption"]))
@FAST
def test_tensor_inputs_invalid(case, which, fn):
    r, vis, T = case
    vis = vis.clone()
    vis[..., 0] = True
    call = {"detect": lambda x, m: F.detect_anchors(x, key_visible=m),
            "variants": lambda x, m: F.absorption_variants(x, key_visible=m),
            "absorption": lambda x, m: F.absorption(x, m)}[fn]
    if which in ("nan", "inf"):
        bad = r.clone()
        bad[..., 0] = math.nan if which == "nan" else math.inf              # at a visible key
        expect(NonFiniteError, "received", call, bad, vis)
        if fn == "detect":                                                   # the explicit policy
            assert not F.detect_anchors(bad, key_visible=vis, nan_policy="omit")[..., 0].any()
    elif which == "shape":
        name = "anchors" if fn == "absorption" else "key_visible"
        expect(ArgumentError, name, call, r, torch.ones(T + 1, dtype=torch.bool))
    elif which == "dtype":
        expect(ArgumentTypeError, "received", call, (r * 10).long(), vis)
    elif which == "int":
        expect(ArgumentTypeError, "received", call, [0.1] * T, vis)
    else:
        name = "anchors" if fn == "absorption" else "key_visible"
        expect(ArgumentTypeError, name, call, r, vis.to(f64))


@given(T=st.integers(1, 8), lead=st.lists(st.integers(1, 3), max_size=2), seed=st.integers(0, 1000),
       kind=st.sampled_from(F.KINDS), causal=st.booleans(), use_q=st.booleans())
@FAST
def test_received_attention_valid_and_invalid(T, lead, seed, kind, causal, use_q):
    g = torch.Generator().manual_seed(seed)
    A = torch.rand(*lead, T, T, generator=g, dtype=f64)
    A = A.tril() if causal else A  # a causal pattern (mass on future keys is refused under causal=True)
    A = A / A.sum(-1, keepdim=True)
    qm = torch.rand(*lead, T, generator=g) > 0.5
    qm[..., 0] = True
    out = F.received_attention(A, query_mask=qm if use_q else None, kind=kind, causal=causal)
    assert out.shape == A.shape[:-1]
    expect(ArgumentError, "pattern", F.received_attention, A.reshape(-1)[:T])   # 1-d: no query axis
    expect(ArgumentError, "query_mask", F.received_attention, A, query_mask=torch.ones(T + 1, dtype=torch.bool))
    expect(ArgumentError, "query_mask", F.received_attention, A, query_mask=torch.zeros(T, dtype=torch.bool))
    expect(ArgumentError, "kind", F.received_attention, A, kind="avg")
    bad = A.clone()
    bad[..., 0, 0] = math.nan
    expect(NonFiniteError, "pattern", F.received_attention, bad)
    assert torch.isfinite(F.received_attention(bad, nan_policy="omit")).all()


@given(T=st.integers(1, 12), data=st.data())
@FAST
def test_uniform_null_and_masks(T, data):
    pos = data.draw(st.lists(st.integers(-T, T - 1), min_size=1, max_size=T, unique_by=lambda p: p % T))
    assert 0 <= F.uniform_null(T, causal=data.draw(st.booleans()), positions=pos) <= 100 + 1e-9
    expect(ArgumentError, "T", F.uniform_null, 0)
    expect(ArgumentTypeError, "T", F.uniform_null, 4.0)
    expect(ArgumentError, "variant", F.uniform_null, T, variant="max")
    expect(OutOfRangeError, "positions", F.uniform_null, T, positions=[T])
    expect(OutOfRangeError, "positions", F.uniform_null, T, positions=[-T - 1])
    expect(ArgumentError, "query_mask", F.uniform_null, T, query_mask=[True] * (T + 1))
    expect(ArgumentError, "query_mask", F.uniform_null, T, query_mask=[False] * T)
    expect(ArgumentError, "n_key", F.visibility_mask, 2, 0)
    expect(ArgumentError, "key_visible", F.uniform_pattern, T, key_visible=torch.ones(T + 1, dtype=torch.bool))
    expect(ArgumentError, "ndim", F.align_mask, torch.ones(2, T, dtype=torch.bool), 1)
    expect(OutOfRangeError, "batch_dim", F.align_mask, torch.ones(2, T, dtype=torch.bool), 4, batch_dim=7)
    assert F.align_mask(torch.ones(2, T, dtype=torch.bool), 4, batch_dim=-3).shape == (1, 2, 1, T)


# ---------------------------------------------------------------------------------------------- drift

@given(S=st.integers(1, 6), K=st.integers(1, 8), seed=st.integers(0, 1000), use_commit=st.booleans())
@FAST
def test_drift_and_statistics(S, K, seed, use_commit):
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(2, S, K, generator=g, dtype=f64)
    a = torch.rand(2, S, K, generator=g) > 0.6
    commit = torch.randint(-1, S, (2, K), generator=g)
    d = D.drift(a, r, commit_step=commit if use_commit else None)
    assert d.persistence.shape == (2, K) and d.n_anchors.shape == (2, S)
    lab = D.classify_layer(d, D.initial_absorption(r))
    assert lab.labels.shape == (2,)
    expect(ArgumentTypeError, "anchors", D.drift, a.long(), r)
    expect(ArgumentError, "received", D.drift, a[:, 0], r[:, 0, 0])         # no step axis
    expect(ArgumentError, "commit_step", D.drift, a, r, commit_step=commit[:, :1].expand(2, K + 1))
    expect(ArgumentError, "commit_step", D.drift, a, r, commit_step=commit - (S + 1))  # every value < -1
    bad = r.clone()
    bad[0, 0, 0] = math.nan
    expect(NonFiniteError, "received", D.drift, a, bad)
    vis = torch.ones(2, K, dtype=torch.bool)
    vis[0, 0] = False
    D.drift(a, bad, key_visible=vis)                                        # NaN at an invisible key: fine
    expect(ArgumentError, "persist", D.classify_layer, d, 0.0, persist=1.5)
    expect(ArgumentTypeError, "drift_result", D.classify_layer, "d", 0.0)
    expect(ArgumentError, "n_initial", D.initial_absorption, r, n_initial=0)
    x = torch.arange(K, dtype=f64)
    y = x.clone()
    y[0] = math.nan
    expect(NonFiniteError, "y", D.spearman, x, y)
    expect(NonFiniteError, "y", D.ols_slope, x, y)
    expect(ArgumentError, "q", D.wasserstein1, r[0, 0], r[0, 0, :1].expand(K + 1).contiguous())
    expect(ArgumentError, "p", D.wasserstein1, -r[0, 0] - 1, r[0, 0])
    expect(OutOfRangeError, "axis", lab.distribution, 3)


# ---------------------------------------------------------------------------------------------- qk

@given(T=st.integers(2, 7), kv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), seed=st.integers(0, 1000),
       causal=st.booleans(), data=st.data())
@FAST
def test_decompose_and_maps(T, kv, rep, seed, causal, data):
    H = kv * rep
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, H, 4, generator=g, dtype=f64)
    k = torch.randn(2, T, kv, 4, generator=g, dtype=f64)
    anchor = data.draw(st.integers(-T, T - 1))
    anchor_c = anchor % T if not causal else 0                              # causal: every query sees key 0
    res = qk.decompose(q, k, anchor_c, causal=causal, v=k)
    assert res.norm_term.shape == (2, H)
    assert torch.allclose(res.norm_term + res.angle_term, res.advantage)
    qk.decompose(q, k, anchor)                                              # negative anchors as in Python
    expect(OutOfRangeError, "anchor", qk.decompose, q, k, T)
    expect(OutOfRangeError, "anchor", qk.decompose, q, k, torch.tensor([0, T]))
    expect(ArgumentError, "k", qk.decompose, q, k[:, :-1], 0)
    expect(ArgumentError, "share", qk.decompose, q, k, 0, share=0.2)
    vis = torch.ones(2, T, dtype=torch.bool)
    vis[:, 0] = False
    expect(OutOfRangeError, "anchor", qk.decompose, q, k, 0, key_visible=vis)
    bad = q.clone()
    bad[0, 0, 0, 0] = math.inf
    expect(NonFiniteError, "q", qk.decompose, bad, k, 0)
    expect(ArgumentError, "n_kv_heads", qk.kv_head_index, 3, 2)
    expect(ArgumentError, "mode", qk.kv_head_index, 4, 2, mode="hf")
    expect(NonFiniteError, "norm_term", qk.qk_label, torch.tensor([math.nan]), torch.tensor([1.0]))
    h = data.draw(st.integers(-H, H - 1))
    for mode in ("paper", "default"):
        m = qk.paper_qk_maps(q, k, head_avg=False, head=h, mode=mode, causal=causal)
        assert m.qk.shape == (2, T, T)
        expect(OutOfRangeError, "head", qk.paper_qk_maps, q, k, head_avg=False, head=H, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qk.paper_qk_maps(None, k, head_avg=False, head=data.draw(st.integers(0, 2 * H)))
        expect(OutOfRangeError, "head", qk.paper_qk_maps, None, k, head_avg=False, head=-1)
    expect(ArgumentError, "head", qk.paper_qk_maps, q, k, head_avg=False)
    expect(ArgumentError, "q", qk.paper_qk_maps, None, k, mode="default")
    expect(ArgumentError, "mode", qk.paper_qk_maps, q, k, mode="ref")


# ---------------------------------------------------------------------------------------------- flow

@given(T=st.integers(2, 9), L=st.integers(1, 3), seed=st.integers(0, 1000), causal=st.booleans(),
       mode=st.sampled_from(["default", "paper"]), data=st.data())
@FAST
def test_flow_valid_and_invalid(T, L, seed, causal, mode, data):
    g = torch.Generator().manual_seed(seed)
    A = torch.rand(L, T, T, generator=g, dtype=f64)
    if causal:
        A = A.tril()
    A = A / A.sum(-1, keepdim=True)
    cut = data.draw(st.integers(1, T - 1))
    regs = [FL.Region("bos", 0, 1, "bos"), FL.Region("gold", 1, cut + 1 if cut + 1 <= T else T, "gold")]
    regs = [r for r in regs if r.end > r.start]
    res = FL.flow(A, regs, causal=causal, mode=mode, warn=False)
    assert res.answer_row.shape[-1] == len(res.regions)
    expect(ArgumentError, "attn", FL.flow, A[0], regs)                       # no layer axis
    expect(ArgumentError, "attn", FL.flow, A[..., :-1], regs)                # not square
    expect(ArgumentError, "mode", FL.flow, A, regs, mode="af")
    expect(ArgumentError, "residual", FL.flow, A, regs, residual=1.5)
    expect(ArgumentTypeError, "regions", FL.flow, A, regs[0])                 # a lone Region, not a list
    expect(ArgumentError, "regions", FL.flow, A, [FL.Region("x", 0, T + 1)])
    expect(ArgumentError, "regions", FL.complete_regions, [FL.Region("a", 0, 2), FL.Region("b", 1, 3)], T + 2)
    bad = A.clone()
    bad[0, 0, 0] = math.nan
    expect(NonFiniteError, "attn", FL.flow, bad, regs)
    expect(ArgumentError, "attn", FL.rollout, -A)
    expect(ArgumentError, "start", FL.Region, "x", -1, 2)
    expect(ArgumentError, "end", FL.Region, "x", 3, 2)
    expect(ArgumentError, "kind", FL.Region, "x", 0, 2, "passage")
    expect(ArgumentTypeError, "start", FL.CharSpan, "x", 0.5, 2)
    expect(ArgumentError, "keep[0]", FL.paper_region_shift, regs, keep=["bogus"])
    expect(ArgumentTypeError, "offsets[0]", FL.regions_from_char_spans, [], [(0,)])
    expect(ArgumentError, "pad_mask", FL.regions_from_char_spans, [], [(0, 1)], pad_mask=[True, False])


# ---------------------------------------------------------------------------------------------- run adapters

def _model(causal=False):
    cfg = MDMConfig(d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, d_mlp=32, d_vocab=30, n_ctx=64,
                    mask_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    attention="causal" if causal else "bidirectional")
    return HookedMDM.from_config(cfg, seed=0, init_std=0.2)


MDM = _model()
TOK = torch.randint(5, 30, (2, 7), generator=torch.Generator().manual_seed(0))
OUT = MDM.generate(TOK[:1, :4], steps=3, gen_length=3, record=[ReceivedAttention(layers=[0, 2])])


@given(layers=st.none() | st.lists(st.integers(-4, 3), min_size=1, max_size=4, unique_by=lambda l: l % 4),
       mode=st.sampled_from(["default", "paper"]), head=st.sampled_from(["mean", "each"]),
       rule=st.sampled_from(F.RULES))
@MODEL
def test_absorption_by_layer_valid(layers, mode, head, rule):
    if mode == "paper" and (head, rule) != ("mean", "zscore"):  # ignored by paper mode: refused (test_ignored_arguments)
        return
    res = R.absorption_by_layer(MDM, TOK, mode=mode, head=head, rule=rule, layers=layers)
    assert res.layers == ([l % 4 for l in layers] if layers is not None else [0, 1, 2, 3])
    assert res.per_sample.shape[:2] == (2, len(res.layers))


@pytest.mark.parametrize("layers, err", [([7], OutOfRangeError), ([4], OutOfRangeError), ([-5], OutOfRangeError),
                                         ([1, -3], OutOfRangeError), (1.0, ArgumentTypeError),
                                         ("0", ArgumentTypeError), ([], OutOfRangeError)])
def test_absorption_by_layer_refuses_bad_layers(layers, err):
    expect(err, "layers", R.absorption_by_layer, MDM, TOK, layers=layers)   # never wraps [7] to layer 3
    expect(err, "layers", R.final_attention, MDM, TOK, layers=layers)
    expect(err, "layers", R.layer_list, MDM, layers)


def test_run_adapters_refuse_bad_arguments():
    expect(ArgumentError, "mode", R.absorption_by_layer, MDM, TOK, mode="af")
    expect(ArgumentError, "rule", R.absorption_by_layer, MDM, TOK, rule="sigma")
    expect(ArgumentError, "head", R.absorption_by_layer, MDM, TOK, head=0)
    expect(ArgumentTypeError, "tokens", R.final_attention, MDM, TOK.float())
    expect(ArgumentError, "attention_mask", R.final_attention, MDM, TOK, attention_mask=torch.ones(2, 6, dtype=torch.long))
    expect(ArgumentError, "attention_mask", R.final_attention, MDM, TOK, attention_mask=2 * torch.ones_like(TOK))
    expect(OutOfRangeError, "layer", R.qk_at_layer, MDM, TOK, 4)
    expect(OutOfRangeError, "anchor", R.qk_at_layer, MDM, TOK, 0, anchor=7)
    expect(ArgumentError, "query", R.qk_at_layer, MDM, TOK, 0, query="prompt")
    expect(ArgumentError, "query", R.qk_at_layer, MDM, TOK, 0, query="masked")   # no [MASK] in TOK
    expect(ArgumentError, "rule", R.qk_at_layer, MDM, TOK, 0, rule="sigma")
    expect(OutOfRangeError, "step", R.step_canvas, OUT, 3)
    expect(ArgumentError, "record", R.anchors_over_steps, OUT, record="patterns")
    expect(OutOfRangeError, "layer", R.anchors_over_steps, OUT, layer=1)          # not recorded
    expect(OutOfRangeError, "layer", R.anchors_over_steps, OUT, layer=-3)
    expect(OutOfRangeError, "head", R.anchors_over_steps, OUT, head=2)
    expect(ArgumentError, "head", R.anchors_over_steps, OUT, head="max")
    expect(ArgumentError, "rule", R.drift_from_output, OUT, rule="sigma")
    expect(ArgumentError, "prompts", R.generate_final, MDM, [])
    expect(ArgumentError, "gen_length", R.generate_final, MDM, [TOK[0]], gen_length=0)
    expect(ArgumentError, "items", R.flow_for_items, MDM, [])
    res = R.absorption_by_layer(MDM, TOK)
    expect(ArgumentError, "metrics[0]", res.to_frame, metrics=["average"])
    expect(ArgumentTypeError, "metrics", res.to_frame, metrics="mean")


@given(layer=st.integers(-4, 3), anchor=st.none() | st.integers(-7, 6), head=st.integers(-2, 1),
       rule=st.sampled_from(F.RULES), step=st.integers(-3, 2))
@MODEL
def test_run_adapters_valid(layer, anchor, head, rule, step):
    res = R.qk_at_layer(MDM, TOK, layer, anchor=anchor, query="unmasked")
    if anchor is not None:
        assert (res.anchor == anchor % 7).all()
    x, am = R.step_canvas(OUT, step)
    assert torch.equal(x, OUT.trajectory.x_steps[step % 3])
    rec_layer = [0, 2][layer % 2] if layer >= 0 else [0, 2][layer % 2 - 2]
    # a negative layer counts from the model's 4 layers (-2 is layer 2, -4 layer 0), not from the recorded ones
    sa = R.anchors_over_steps(OUT, layer=rec_layer if layer >= 0 else rec_layer - 4, head=head, rule=rule)
    assert sa.anchors.shape == (1, 3, OUT.tokens.shape[1])
    d = R.drift_from_output(OUT, layer=rec_layer, rule=rule)
    assert d.n_anchors.shape == (1, 3)


# ---------------------------------------------------------------------------------------------- retrieval

def test_retrieval_arguments():
    p = torch.arange(5, 15)
    expect(OutOfRangeError, "evidence[0][1]", RT.RetrievalItem, p, [(4, 11)], "x")
    expect(ArgumentTypeError, "evidence", RT.RetrievalItem, p, (4, 5), "x")
    expect(OutOfRangeError, "gold_doc[0]", RT.RetrievalItem, p, [(4, 5)], "x", gold_doc=(-1, 3))
    expect(ArgumentError, "answer", RT.RetrievalItem, p, [(4, 5)], "  ")
    expect(ArgumentTypeError, "prompt_ids", RT.RetrievalItem, p.float(), [(4, 5)], "x")
    it = RT.RetrievalItem(p, [(4, 5)], [9])
    expect(ArgumentError, "method", RT.retrieval_scores, MDM, [it], method="copy")
    expect(ArgumentError, "method", RT.retrieval_scores, MDM, [it], method="wu")   # an MDM
    expect(OutOfRangeError, "layers", RT.retrieval_scores, MDM, [it], layers=[4])
    expect(ArgumentError, "threshold", RT.retrieval_scores, MDM, [it], threshold=1.5)
    expect(ArgumentError, "items", RT.retrieval_scores, MDM, [])
    expect(ArgumentError, "gen_length", RT.retrieval_scores, MDM, [it], gen_length=0)
    expect(OutOfRangeError, "heads[0][1]", RT.head_mask_hooks, [(0, 2)], model=MDM)
    expect(OutOfRangeError, "heads[0][0]", RT.head_mask_hooks, [(-1, 0)])
    expect(ArgumentTypeError, "heads", RT.head_mask_hooks, (0, 1))
    expect(ArgumentError, "heads", RT.head_mask_hooks, [(0, 1), (-4, -1)], model=MDM)   # the same head twice
    assert RT.head_mask_hooks([(-1, -1)], model=MDM)[0][0] == "blocks.3.attn.hook_z"
    expect(ArgumentError, "method", RT.head_mask_hooks, [(0, 1)], method="mean")
    expect(ArgumentError, "k", RT.ablation_accuracy, MDM, [it], [(0, 1)], k=0)
    expect(ArgumentError, "k", RT.ablation_accuracy, MDM, [it], [(0, 1)], k=2)   # only one ranked head
    expect(ArgumentError, "n_random", RT.ablation_accuracy, MDM, [it], [(0, 1)], k=1, n_random=0)
    scores = RT.retrieval_scores(MDM, [it], layers=[-1], gen_length=2, only_correct=False)
    assert scores.layers == [3] and scores.scores.shape == (1, 2)
    assert len(scores.top(2)) == 2
    expect(ArgumentError, "k", scores.top, 3)
