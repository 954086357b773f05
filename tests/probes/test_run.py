"""Adapters of mdm_lens.probes.run on tiny random models (never the zoo weights).

Planted phenomena: a hook on ``hook_attn_scores`` that adds a large bias to one key column makes that
key an anchor at every query of one layer (the same effect a learned sink has, without training).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention
from mdm_lens.errors import ArgumentError
from mdm_lens.probes import flow
from mdm_lens.probes import run as R

SETTINGS = settings(max_examples=15, deadline=None)


def tiny(causal=False, shift=False, vocab=40, kv=2, seed=0, std=0.2):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv, d_mlp=64, d_vocab=vocab, n_ctx=128,
                    mask_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_shift=shift,
                    attention="causal" if causal else "bidirectional")
    return HookedMDM.from_config(cfg, seed=seed, init_std=std)


MDM, ARM = tiny(), tiny(causal=True)


def bias_key(pos, layer=0, amount=20.0):
    """Rig: every query of ``layer`` sees key ``pos`` with +amount on its pre-softmax score."""
    def hook(scores, hook):
        s = scores.clone()
        col = s[..., pos]
        s[..., pos] = torch.where(torch.isfinite(col), col + amount, col)
        return s
    return (f"blocks.{layer}.attn.hook_attn_scores", hook)


def toks(b=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 40, (b, T), generator=g)


# ---------------------------------------------------------------------------------------------- final attention

@pytest.mark.parametrize("model", [MDM, ARM], ids=["mdm", "arm"])
def test_final_attention_rows_sum_to_one(model):
    t = toks()
    am = torch.ones_like(t)
    am[1, -3:] = 0                                                        # right padding in row 1
    t[1, -3:] = 0
    A = R.final_attention(model, t, attention_mask=am)
    assert A.shape == (2, 2, 4, 12, 12)
    assert torch.allclose(A.sum(-1), torch.ones(A.shape[:-1]), atol=1e-5)
    assert float(A[1, ..., -3:].abs().max()) == 0.0                          # pads never attended
    if model.cfg.attention == "causal":
        assert float(A.triu(1).abs().max()) == 0.0
    assert R.final_attention(model, t[0], layers=-1).shape == (1, 1, 4, 12, 12)


# ---------------------------------------------------------------------------------------------- absorption

def test_paper_mode_mdm_is_top1_share_and_arm_is_column0():
    t = toks(3, 10)
    for model, expect in ((MDM, lambda m: m.amax(-1)), (ARM, lambda m: m[..., 0])):
        A = R.final_attention(model, t).to(torch.float64).mean(2)          # head mean [b, l, q, k]
        m = A.mean(-2)                                                     # received mass per key
        res = R.absorption_by_layer(model, t, mode="paper")
        assert res.variants == (("pos0",) if model is ARM else ("top1",))
        assert torch.allclose(res.per_sample[..., 0], 100 * expect(m), atol=1e-9)
        assert torch.allclose(res.mean[:, 0], 100 * expect(m).mean(0), atol=1e-9)
        assert torch.allclose(res.std[:, 0], 100 * expect(m).std(0, unbiased=False), atol=1e-9)


def test_default_mode_variants_nulls_and_paper_agreement():
    T = 10
    t = toks(2, T)
    H = sum(1 / k for k in range(1, T + 1))
    mdm, arm = R.absorption_by_layer(MDM, t), R.absorption_by_layer(ARM, t)
    assert mdm.variants == ("pos0", "top1", "anchors")
    assert torch.allclose(mdm.null[..., 0], torch.full((2, 2), 100 / T, dtype=torch.float64))
    assert torch.allclose(arm.null[..., 1], torch.full((2, 2), 100 * H / T, dtype=torch.float64))
    assert torch.allclose(mdm.per_sample[..., 1], R.absorption_by_layer(MDM, t, mode="paper").per_sample[..., 0])
    assert torch.allclose(arm.per_sample[..., 0], R.absorption_by_layer(ARM, t, mode="paper").per_sample[..., 0])
    assert torch.allclose(mdm.excess, mdm.per_sample - mdm.null)
    tab = mdm.table()
    assert list(tab.index) == [0, 1] and {"top1", "top1_std", "top1_null", "anchors_excess"} <= set(tab.columns)
    each = R.absorption_by_layer(MDM, t, head="each")
    assert each.per_sample.shape == (2, 2, 3)


def test_planted_anchor_absorption():
    t = toks(2, 12)
    with MDM.hooks(fwd_hooks=[bias_key(5)]):
        res = R.absorption_by_layer(MDM, t)
    assert (res.per_sample[:, 0, 2] > 95).all()                            # layer 0: anchors variant
    assert (res.n_anchors[:, 0] == 1).all()


@SETTINGS
@given(T=st.integers(2, 16), b=st.integers(1, 3), seed=st.integers(0, 10_000), causal=st.booleans(),
       mode=st.sampled_from(["default", "paper"]), pad=st.integers(0, 1))
def test_absorption_is_a_percentage(T, b, seed, causal, mode, pad):
    model = ARM if causal else MDM
    t = toks(b, T, seed)
    am = torch.ones_like(t)
    if pad and T > 2:
        am[0, -1] = 0
        t[0, -1] = 0
    res = R.absorption_by_layer(model, t, attention_mask=am, mode=mode)
    v = res.per_sample
    assert torch.isfinite(v).all() and (v >= -1e-9).all() and (v <= 100 + 1e-9).all()


# ---------------------------------------------------------------------------------------------- steps

def test_anchors_over_steps_layout_and_planted_drift():
    a = 4
    out = MDM.generate(toks(2, 10), steps=4, gen_length=4, record=[ReceivedAttention()], fwd_hooks=[bias_key(a)])
    sa = R.anchors_over_steps(out)
    assert sa.anchors.shape == (2, 2, 4, 14) and sa.lead_dims == ("batch", "layer")
    rec = out.records["received_attention"].to(torch.float64)              # [step, batch, layer, head, key]
    assert torch.allclose(sa.received, rec.mean(3).permute(1, 2, 0, 3))
    assert sa.anchors[:, 0, :, a].all() and sa.anchors[:, 0].sum(-1).eq(1).all()
    d = R.drift_from_output(out, layer=0)
    assert d.modal_anchor.tolist() == [a, a] and torch.allclose(d.stability, torch.ones(2, dtype=torch.float64))
    assert d.anchor_types.shape == (2, 4, 4) and d.anchor_types[..., 0].eq(1).all()    # a prompt anchor
    per_head = R.anchors_over_steps(out, layer=0, head="each")
    assert per_head.anchors.shape == (2, 4, 4, 14) and per_head.lead_dims == ("batch", "head")
    assert len(R.anchors_over_steps(out, layer=1, head=2).to_frame()) > 0


def test_arm_steps_hide_keys_beyond_the_prefix():
    P, G = 8, 4
    out = ARM.generate(toks(1, P), steps=G, gen_length=G, record=[ReceivedAttention()], fwd_hooks=[bias_key(2)])
    sa = R.anchors_over_steps(out, layer=0)
    for s in range(G):
        assert torch.isfinite(sa.received[0, s, : P + s]).all()
        assert torch.isnan(sa.received[0, s, P + s:]).all()
        assert not sa.anchors[0, s, P + s:].any()
    assert sa.anchors[0, :, 2].all()
    d = R.drift_from_output(out, layer=0)
    assert int(d.modal_anchor[0]) == 2


# ---------------------------------------------------------------------------------------------- qk

def test_qk_at_layer_matches_the_score_gap_and_detects_the_anchor():
    t = toks(2, 10)
    res = R.qk_at_layer(MDM, t, layer=1)
    _, cache = MDM.run_with_cache(t, names_filter=["blocks.1.attn.hook_attn_scores", "blocks.1.attn.hook_pattern"])
    S = cache["blocks.1.attn.hook_attn_scores"].to(torch.float64)          # q·k/√d per head
    m = cache["blocks.1.attn.hook_pattern"].to(torch.float64).mean(1).mean(-2)
    anchor = m.argmax(-1)
    assert res.anchor[:, 0].tolist() == anchor.tolist()
    for b in range(2):
        j = int(anchor[b])
        rest = [k for k in range(10) if k != j]
        gap = (S[b, :, :, j] - S[b][:, :, rest].mean(-1)).mean(-1)         # mean_i (S_i* − mean_R S_ij)
        assert torch.allclose(res.advantage[b], gap, atol=1e-5)
    assert torch.allclose(res.norm_term + res.angle_term, res.advantage)
    fixed = R.qk_at_layer(MDM, t, layer=1, anchor=3, query="all")
    assert fixed.anchor.eq(3).all()
    canvas = t.clone()
    canvas[:, -3:] = 3
    masked = R.qk_at_layer(MDM, canvas, layer=0, query="masked")
    assert masked.n_queries.eq(3).all()


def test_qk_zscore_anchor_under_planted_bias():
    with ARM.hooks(fwd_hooks=[bias_key(1, layer=0)]):
        res = R.qk_at_layer(ARM, toks(1, 10), layer=0, rule="zscore")
    assert res.anchor.eq(1).all()


# ---------------------------------------------------------------------------------------------- regions / flow

def test_regions_for_item_from_one_tokenisation():
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    item = D.make_dataset(1, seed=0, n_distractors=2, gold_position=1)[0]
    ids, off = ZT.encode_with_offsets(item.prompt)
    regs = R.regions_for_item(item, answer_length=4, offsets=off, total_length=len(ids) + 6)
    assert regs[0].start == 0 and regs[-1].end == len(ids) + 6
    assert all(a.end == b.start for a, b in zip(regs, regs[1:]))          # a partition
    by = {r.name: r for r in regs}
    assert by["bos"].kind == "bos" and len(by["bos"]) == 1
    assert [r.kind for r in regs if r.name.startswith("doc")] == ["doc", "gold", "doc"]
    text = lambda r: ZT.decode(ids[r.start:r.end])                         # noqa: E731
    assert text(by["query"]) == item.question
    assert text(by["doc2"]) == "[2] " + item.passages[1]
    assert text(by["question_cue"]) == "question :" and text(by["answer_cue"]) == "answer :"
    assert (by["answer"].start, by["answer"].end) == (len(ids), len(ids) + 4)
    assert by["pad"].kind == "pad" and len(by["pad"]) == 2
    ev = ZT.char_span_to_token_span(off, item.evidence_span)
    assert by["doc2"].start <= ev[0] < ev[1] <= by["doc2"].end


def test_flow_for_items_runs_both_modes():
    from mdm_lens.zoo import data as D

    from mdm_lens.zoo import tokenizer as ZT

    model = tiny(vocab=322)
    items = D.make_dataset(2, seed=3, n_distractors=2)
    with pytest.raises(ArgumentError, match="no tokenizer"):               # never the zoo's behind its back
        R.flow_for_items(model, items, gen_length=4)
    model.set_tokenizer(ZT.load_tokenizer())
    res = R.flow_for_items(model, items, gen_length=4)
    assert torch.isfinite(res.gold_ratio).all() and res.gold_ratio.shape == (2,)
    df = res.to_frame()
    assert {"item", "region", "kind", "metric", "value"} <= set(df.columns)
    gold_rows = df[(df.metric == "answer_row") & (df.kind == "gold")]
    assert len(gold_rows) == 2
    rows = df[df.metric == "answer_row"].groupby("item").value.sum()
    assert all(math.isclose(v, 1.0, abs_tol=1e-6) for v in rows)
    paper = R.flow_for_items(model, items, mode="paper", gen_length=4)
    assert all(r.mode == "paper" for r in paper.results)
    assert {r.kind for r in paper.results[0].regions} <= set(flow.AF_KINDS)
