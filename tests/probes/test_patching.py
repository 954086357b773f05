"""Knockout and activation patching on a planted anchor (spec §2.8–2.10), and closed-form rigs.

Rig (hooks on a tiny random MDM, layer 0 only): +20 on the pre-softmax score of key A for every query
(``hook_attn_scores``), so A takes ~all of layer 0's attention, and a value vector at A that decides the
canvas logits — either a fixed large V* (knockout) or the token's own value rescaled to norm 30
(patching, so the value depends on which token sits at A).  Known answers: knocking A out changes the
output, knocking out as many random keys does not; patching the corrupted token's layer-0 residual or
value at A reproduces the corrupted run (normalised 0), patching random positions or keys does not.
"""

import math

import pytest
import torch
from transformer_lens import patching as tl_patching

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError, ArgumentTypeError, NonFiniteError, OutOfRangeError
from mdm_lens.probes import patching as PT

A, P = 2, 10


def tiny(shift=False, seed=0):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=40, n_ctx=64, mask_token_id=3,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_shift=shift)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.2)


def prompt(seed=0):
    return torch.randperm(35, generator=torch.Generator().manual_seed(seed))[:P] + 5


def bias(scores, hook):
    s = scores.clone()
    col = s[..., A]
    s[..., A] = torch.where(torch.isfinite(col), col + 20, col)
    return s


V_STAR = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 30


def fixed_value(v, hook):
    v = v.clone()
    v[:, A] = V_STAR
    return v


def own_value(v, hook):
    v = v.clone()
    v[:, A] = 30 * v[:, A] / v[:, A].norm(dim=-1, keepdim=True)
    return v


KNOCK_RIG = [("blocks.0.attn.hook_attn_scores", bias), ("blocks.0.attn.hook_v", fixed_value)]
PATCH_RIG = [("blocks.0.attn.hook_attn_scores", bias), ("blocks.0.attn.hook_v", own_value)]


def no_hooks(model):
    return all(not hp.fwd_hooks for hp in model.hook_dict.values())


# ---------------------------------------------------------------------------------------------- knockout

@pytest.mark.parametrize("queries", ["all", "masked"])
def test_knocking_out_the_planted_anchor_changes_the_output_random_does_not(queries):
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=KNOCK_RIG):
        clean_answer = model.generate(p[None], steps=4, gen_length=4).generated[0]
        res = PT.knockout(model, p, layers=[0], queries=queries, n_random=2, answer=clean_answer, gen_length=4)
    assert res.conditions == ["clean", "anchors", "random"]
    assert res.n_targets[1].eq(1).all() and res.n_targets[2].eq(1).all() and res.n_targets[0].eq(0).all()
    clean, anchors, random = res.metric_mean.tolist()
    assert clean > 0 and anchors < 0                                       # the committed token loses its argmax
    assert abs(random - clean) < 1e-4
    assert res.agreement.tolist()[0] == 1.0 and res.agreement.tolist()[2] == 1.0 and res.agreement[1] < 1.0
    assert res.accuracy.tolist() == [1.0, 0.0, 1.0]
    tab = res.table()
    assert list(tab.index) == res.conditions and {"metric_mean", "agreement", "accuracy"} <= set(tab.columns)
    assert no_hooks(model)


def test_fixed_targets_equal_detected_anchors_and_prob_metric():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=KNOCK_RIG):
        det = PT.knockout(model, p, layers=[0], queries="all", n_random=0, steps=[0, -1])
        fixed = PT.knockout(model, p, layers=[0], queries="all", targets=[A], n_random=1, steps=[0, -1])
        prob = PT.knockout(model, p, layers=[0], queries="all", targets=[A], n_random=0, metric="prob")
    assert det.conditions == ["clean", "anchors"] and fixed.conditions == ["clean", "targets", "random"]
    assert det.steps == [0, 3]
    assert torch.allclose(det.step_metric, fixed.step_metric[:2])
    assert prob.metric_mean[1] < prob.metric_mean[0]
    custom = PT.knockout(model, p, layers=[0], n_random=0, metric=lambda logits: logits.max(-1).values.mean())
    assert torch.isfinite(custom.step_metric).all() and custom.metric == "<lambda>"
    assert no_hooks(model)


@pytest.mark.parametrize("shift", [False, True])
def test_knockout_rows_are_the_readout_rows_of_masked_positions(shift):
    model = tiny(shift=shift)
    x = torch.cat([prompt(), torch.full((4,), 3)])[None]
    x[0, P + 1] = 7                                                        # one canvas slot already committed
    ko = PT.KnockoutHooks(model, [0, 1], targets=[A, 5], queries="masked", prompt_length=P)
    ko.tokens = x
    seen = {}
    rec = lambda s, hook: seen.__setitem__(hook.name, s.clone())          # noqa: E731
    model.run_with_hooks(x, fwd_hooks=ko.hooks() + [("blocks.1.attn.hook_attn_scores", rec)])
    s = seen["blocks.1.attn.hook_attn_scores"][0]                          # [head, query, key]
    masked = [P, P + 2, P + 3]
    rows = [r - int(shift) for r in masked]
    cut = torch.isinf(s[..., [A, 5]]).all(0).all(-1)                       # [query]
    assert cut.nonzero().flatten().tolist() == rows
    assert torch.isfinite(s[..., [0, 1, 3, 4]]).all()
    assert no_hooks(model)


# ---------------------------------------------------------------------------------------------- patching

def corrupt(p):
    c = p.clone()
    c[A] = 9 if int(p[A]) != 9 else 10
    return c


def test_patching_the_anchor_residual_restores_the_corrupted_run():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG):
        res = PT.patch_anchor_activations(model, p, corrupt(p), step=0, component="resid_pre")
    assert res.conditions == ["anchors", "random"] and res.layers == [0, 1]
    assert res.clean_value > res.corrupt_value
    norm = res.normalised
    assert abs(float(norm[0, 0])) < 1e-4                                   # layer 0, anchor A: fully corrupted
    assert float(norm[1, 0]) == pytest.approx(1.0, abs=1e-5)                # random positions: no effect
    assert res.n_positions[0, 0] == 1 and res.n_positions[1, 0] == 1
    # layer 1 (unrigged) has no anchors here: nothing patched, so undefined rather than a fake 1.0
    assert res.n_positions[:, 1].tolist() == [0.0, 0.0] and torch.isnan(norm[:, 1]).all()
    tab = res.table()
    assert list(tab.index) == [0, 1] and list(tab.columns) == ["anchors", "random"]
    assert no_hooks(model)


def test_patching_value_vs_key_at_the_anchor():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG):
        v = PT.patch_anchor_activations(model, p, corrupt(p), step=0, layers=[0], component="v")
        k = PT.patch_anchor_activations(model, p, corrupt(p), step=0, layers=[0], component="k")
        fixed = PT.patch_anchor_activations(model, p, corrupt(p), step=0, layers=[0], positions=[A], n_random=0)
    assert float(v.normalised[0, 0]) < 0.1                                 # the value at A carries the answer
    assert float(k.normalised[0, 0]) > 0.9                                 # its key is irrelevant (score rigged)
    assert fixed.conditions == ["positions"] and abs(float(fixed.normalised[0, 0])) < 1e-4


def test_patching_custom_metric_and_errors():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG):
        res = PT.patch_anchor_activations(model, p, corrupt(p), step=1, layers=[0],
                                          metric=lambda logits: logits.log_softmax(-1).max(-1).values.mean())
        assert res.step == 1 and torch.isfinite(res.value).all()
        with pytest.raises(ValueError):
            PT.patch_anchor_activations(model, p, p[:-1], step=0)
        with pytest.raises(ValueError):
            PT.patch_anchor_activations(model, p, corrupt(p), component="q")
    assert no_hooks(model)


# ---------------------------------------------------------------------------------------------- closed form
# A counting model: one layer, one head, d_model = d_vocab = 8, one-hot embeddings (the mask token's is 0),
# W_Q = W_K = 0 (uniform attention over the visible keys), W_V = W_O = I, no MLP, W_U = ALPHA·I, norm eps
# 1e-12.  At a masked position the residual is (const / n_keys) · counts, where counts[t] is the number of
# kept non-mask keys holding token t, and the final RMSNorm removes the scale: logits = ALPHA·√8·c/‖c‖.
# A hook adds BETA·e_eos at canvas slot P+1, so step 0 commits <eos> there and step 1 commits the answer
# at P — the case where a per-step metric at committed positions says "no effect".

V, ALPHA, BETA, EOS, MASK = 8, 2.0, 10.0, 2, 3
CPROMPT = torch.tensor([1, 4, 4, 4, 5, 5])
CP = len(CPROMPT)


def counting_model():
    cfg = MDMConfig(d_model=V, n_layers=1, n_heads=1, d_mlp=4, d_vocab=V, n_ctx=32, norm_eps=1e-12,
                    mask_token_id=MASK, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    m = HookedMDM.from_config(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.embed.W_E.copy_(torch.eye(V))
        m.embed.W_E[MASK] = 0
        for w in (m.blocks[0].ln1.w, m.blocks[0].ln2.w, m.ln_final.w):
            w.fill_(1.0)
        m.blocks[0].attn.qkv_weight[2 * V:] = torch.eye(V)
        m.blocks[0].attn.o_weight.copy_(torch.eye(V))
        m.unembed.weight.copy_(ALPHA * torch.eye(V))
    return m


def eos_slot(r, hook):
    r = r.clone()
    r[:, CP + 1, EOS] += BETA
    return r


EOS_RIG = [("blocks.0.hook_resid_post", eos_slot)]


def closed_form(counts, gold):
    """(log-prob, rank) of `gold` at a masked slot given the kept non-mask token counts."""
    c = torch.zeros(V, dtype=torch.float64)
    for t, n in counts.items():
        c[t] = n
    logits = ALPHA * math.sqrt(V) * c / c.norm()
    above = logits > logits[gold]
    above[MASK] = False
    return float(logits.log_softmax(-1)[gold]), float(above.sum())


CLEAN0, KNOCK0 = closed_form({1: 1, 4: 3, 5: 2}, 4), closed_form({1: 1, 4: 1, 5: 2}, 4)          # step 0
CLEAN1, KNOCK1 = closed_form({1: 1, 4: 3, 5: 2, EOS: 1}, 4), closed_form({1: 1, 4: 1, 5: 2, EOS: 1}, 4)  # step 1


def test_rig_commits_eos_first_then_the_answer():
    m = counting_model()
    with m.hooks(fwd_hooks=EOS_RIG):
        out = m.generate(CPROMPT[None], steps=2, gen_length=2)
    assert out.generated.tolist() == [[4, EOS]] and out.trajectory.commit_step[0, CP:].tolist() == [1, 0]


def test_knockout_answer_metrics_closed_form_all_steps():
    m = counting_model()
    with m.hooks(fwd_hooks=EOS_RIG):
        res = PT.knockout(m, CPROMPT, layers=[0], targets=[1, 2], n_random=0, answer=[4], gen_length=2)
    assert res.conditions == ["clean", "targets"] and res.metric == "answer_logprob" and res.gold == [[4]]
    close = lambda a, b: torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),  # noqa: E731
                                                    torch.as_tensor(b, dtype=torch.float64), atol=1e-6, rtol=0)
    # teacher-forced: the gold answer at P is still masked at both steps
    close(res.tf_answer_logprob, [[CLEAN0[0], CLEAN1[0]], [KNOCK0[0], KNOCK1[0]]])
    close(res.tf_answer_rank, [[0, 0], [KNOCK0[1], KNOCK1[1]]])
    close(res.tf_answer_logprob_mean, [(CLEAN0[0] + CLEAN1[0]) / 2, (KNOCK0[0] + KNOCK1[0]) / 2])
    # sampled: the answer is committed at step 1; under the knockout token 5 wins there (2 > 1 counts)
    close(res.answer_logprob, [CLEAN1[0], KNOCK1[0]])
    close(res.answer_rank, [0, 1])
    close(res.value, res.answer_logprob)
    close(res.effect, [0, KNOCK1[0] - CLEAN1[0]])
    close(res.exact_match, [1, 0])
    close(res.agreement, [1, 0.5])
    tab = res.table()
    assert list(tab.index) == ["clean", "targets"] and tab.columns[0] == "value"
    assert abs(tab.loc["targets", "answer_logprob"] - KNOCK1[0]) < 1e-6


def test_knockout_at_early_steps_lowers_the_answer_where_the_old_metric_saw_nothing():
    m = counting_model()
    with m.hooks(fwd_hooks=EOS_RIG):
        res = PT.knockout(m, CPROMPT, layers=[0], targets=[1, 2], n_random=0, steps=[0], gen_length=2)
        rank = PT.knockout(m, CPROMPT, layers=[0], targets=[1, 2], n_random=0, steps=[0], gen_length=2,
                           metric="tf_answer_rank")
    assert res.steps == [0] and res.gold_source == "clean generation" and res.gold == [[4]]
    # step 0 commits only the <eos> slot: its margin does not drop (the old metric: "no effect")
    assert res.step_metric[1, 0] >= res.step_metric[0, 0]
    # teacher-forced, the answer's log-prob at step 0 falls by exactly the closed-form amount
    assert abs(float(res.tf_answer_logprob[0, 0]) - CLEAN0[0]) < 1e-6
    assert abs(float(res.tf_answer_logprob[1, 0]) - KNOCK0[0]) < 1e-6
    # sampled: step 1 is not knocked and sees the same canvas, so the final answer is unchanged
    assert abs(float(res.effect[1])) < 1e-9 and res.exact_match.tolist() == [1.0, 1.0]
    assert rank.metric == "tf_answer_rank" and rank.value.tolist() == [0.0, KNOCK0[1]]


def test_knockout_validates_its_arguments():
    m = counting_model()
    kw = dict(layers=[0], targets=[1], n_random=0, gen_length=2)
    with pytest.raises(OutOfRangeError, match="steps"):
        PT.knockout(m, CPROMPT, steps=[2], **kw)
    with pytest.raises(OutOfRangeError, match="layers"):
        PT.knockout(m, CPROMPT, **dict(kw, layers=[1]))
    with pytest.raises(OutOfRangeError, match="targets"):
        PT.knockout(m, CPROMPT, **dict(kw, targets=[CP + 2]))
    with pytest.raises(ArgumentError, match="metric"):
        PT.knockout(m, CPROMPT, metric="answer_prob", **kw)
    with pytest.raises(ArgumentTypeError, match="n_random"):
        PT.knockout(m, CPROMPT, **dict(kw, n_random=1.5))
    with pytest.raises(ArgumentError, match="queries"):
        PT.knockout(m, CPROMPT, queries="committed", **kw)
    with pytest.raises(ArgumentError, match="does not fit"):
        PT.knockout(m, CPROMPT, answer=[4, 4], answer_offset=1, **kw)
    with pytest.raises(ArgumentError, match=r"answer\[0\]"):
        PT.knockout(m, CPROMPT, answer=[V], **kw)
    nan = lambda r, hook: r * torch.nan  # noqa: E731
    with m.hooks(fwd_hooks=[("blocks.0.hook_resid_post", nan)]), pytest.raises(NonFiniteError, match="logits"):
        PT.knockout(m, CPROMPT, **kw)
    assert no_hooks(m)


def test_arm_teacher_forced_steps_add_up_to_the_sampled_answer():
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=40, n_ctx=64, attention="causal",
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = HookedMDM.from_config(cfg, seed=3, init_std=0.2)
    res = PT.knockout(model, prompt(), layers=[0, 1], targets=[0, 1], n_random=1, answer=[7, 9, 11], gen_length=3)
    # the clean run's canvases are the teacher-forced ones once the gold is placed, and an ARM predicts each
    # answer position exactly once (at its own step), so the per-step log-probs add up to the sampled one
    assert torch.isfinite(res.tf_answer_logprob).all() and torch.isfinite(res.answer_logprob).all()
    gold_free = PT.knockout(model, prompt(), layers=[0], targets=[0], n_random=0, gen_length=3)
    assert abs(float(gold_free.tf_answer_logprob[0].sum() - gold_free.answer_logprob[0])) < 1e-9
    assert gold_free.tf_answer_rank[0].tolist() == [0.0, 0.0, 0.0]          # greedy: the clean token is the argmax
    assert res.conditions == ["clean", "targets", "random"] and res.exact_match.shape == (3,)


# ---------------------------------------------------------------------------------------------- directions

def test_denoising_restores_exactly_at_the_anchor_and_not_elsewhere():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG):
        den = PT.patch_anchor_activations(model, p, corrupt(p), step=0, layers=[0], direction="denoising", n_random=2)
        noi = PT.patch_anchor_activations(model, p, corrupt(p), step=0, layers=[0], direction="noising", n_random=2)
    assert den.direction == "denoising" and den.conditions == ["anchors", "random0", "random1"]
    assert (den.clean_value, den.corrupt_value) == (noi.clean_value, noi.corrupt_value)
    # layer 0's residual differs between the runs only at A (the replaced token): patching the clean one in
    # rebuilds the clean run (1), patching any other position copies identical values (0); noising mirrors it
    torch.testing.assert_close(den.normalised[:, 0], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(noi.normalised[:, 0], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), atol=1e-5, rtol=0)
    assert abs(float(den.value[0, 0]) - den.clean_value) < 1e-5 and abs(float(noi.value[0, 0]) - noi.corrupt_value) < 1e-5
    assert no_hooks(model)


def test_matched_canvases_run_through_transformer_lens_patching_unchanged():
    model, p = tiny(), prompt()
    out = model.generate(p[None], steps=4, gen_length=4)
    pair = PT.matched_canvases(out, corrupt(p), step=1, model=model)
    assert pair.clean.shape == pair.corrupted.shape == (1, P + 4)
    assert torch.equal(pair.clean, out.trajectory.x_steps[1]) and pair.differ[0].nonzero().flatten().tolist() == [A]
    assert torch.equal(pair.masked, pair.corrupted == 3) and int(pair.masked.sum()) == 3
    pos = int(pair.committed[0].nonzero()[0])
    t = int(out.tokens[0, pos])
    c = (t + 1) % 40
    metric = lambda logits: logits[0, pos, t] - logits[0, pos, c]  # noqa: E731
    _, clean_cache = model.run_with_cache(pair.clean)
    with torch.no_grad():
        m_clean, m_corr = float(metric(model(pair.clean))), float(metric(model(pair.corrupted)))
    rp = tl_patching.get_act_patch_resid_pre(model, pair.corrupted, clean_cache, metric)
    assert rp.shape == (2, P + 4)
    assert abs(float(rp[0, A]) - m_clean) < 1e-4                               # the only differing input
    others = [j for j in range(P + 4) if j != A]
    assert torch.allclose(rp[0, others], torch.full((len(others),), m_corr), atol=1e-5)
    ho = tl_patching.get_act_patch_attn_head_out_by_pos(model, pair.corrupted, clean_cache, metric)
    assert ho.shape == (2, P + 4, 4)
    # the last layer's head outputs reach the logits only at their own position
    not_read = [j for j in range(P + 4) if j != pos]
    assert torch.allclose(ho[1, not_read], torch.full((len(not_read), 4), m_corr), atol=1e-5)
    # our denoising patch at one position is TransformerLens' number, layer by layer
    for j in (A, pos):
        ours = PT.patch_anchor_activations(model, p, corrupt(p), step=1, positions=[j], n_random=0,
                                           direction="denoising", gen_length=4,
                                           metric=lambda lg: lg[0, t] - lg[0, c])
        torch.testing.assert_close(ours.value[0].float(), rp[:, j].float(), atol=1e-4, rtol=0)


def test_patching_and_canvases_validate_their_arguments():
    model, p = tiny(), prompt()
    out = model.generate(p[None], steps=4, gen_length=4)
    with pytest.raises(OutOfRangeError, match="step"):
        PT.matched_canvases(out, corrupt(p), step=4)
    with pytest.raises(ArgumentError, match="corrupt"):
        PT.matched_canvases(out, p[:-1], step=0)
    bad = p.clone()
    bad[0] = 3
    with pytest.raises(ArgumentError, match="mask token"):
        PT.matched_canvases(out, bad, step=0, model=model)
    with pytest.raises(ArgumentError, match="direction"):
        PT.patch_anchor_activations(model, p, corrupt(p), direction="clean_to_corrupt")
    with pytest.raises(OutOfRangeError, match="positions"):
        PT.patch_anchor_activations(model, p, corrupt(p), positions=[P + 4])
    with pytest.raises(OutOfRangeError, match="step"):
        PT.patch_anchor_activations(model, p, corrupt(p), step=-5)
    with pytest.raises(OutOfRangeError, match="layers"):
        PT.patch_anchor_activations(model, p, corrupt(p), layers=[2])
    with pytest.raises(ArgumentError, match="tokens"):
        PT.patch_anchor_activations(model, p, corrupt(p), tokens=(5,))
    with pytest.raises(NonFiniteError, match="scores"):
        PT.anchor_mask_from_scores(torch.full((1, 2, 3, 3), torch.nan))
    assert no_hooks(model)


def test_gold_answers_and_prompts():
    from mdm_lens.probes import _causal as C

    m = counting_model()
    # the clean run's answer: tokens up to the first EOS/pad; a row that starts with EOS answers "EOS"
    assert C.clean_answer(m, torch.tensor([[4, EOS, 5, 6], [EOS, 4, 4, 4], [5, 6, 7, 4]]), 0) == [[4], [EOS], [5, 6, 7, 4]]
    assert C.clean_answer(m, torch.tensor([[6, 4, 0, 5]]), 1) == [[4]]
    assert C.gold_answer(m, torch.tensor([4, 5]), 2, 3, 1) == [[4, 5], [4, 5]]
    grid = C.gold_grid([[4, 5]], 6, 10, 1, "cpu")
    assert grid.tolist() == [[-1] * 7 + [4, 5, -1]]
    with pytest.raises(ArgumentError, match="no tokenizer"):
        C.gold_answer(m, "paris", 1, 2, 0)
    with pytest.raises(ArgumentTypeError, match="prompt_ids"):
        PT.knockout(m, CPROMPT.float(), layers=[0], targets=[1], n_random=0, gen_length=2)


# ---------------------------------------------------------------------------------------------- undefined ratios

def flat(scores, hook):
    """Every visible key gets the same score: a uniform pattern, so the layer has no anchors."""
    return torch.where(torch.isfinite(scores), torch.zeros_like(scores), scores)


@pytest.mark.parametrize("direction", ["noising", "denoising"])
def test_normalised_is_nan_with_a_reason_when_clean_equals_corrupted(direction):
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG):
        res = PT.patch_anchor_activations(model, p, p.clone(), step=0, direction=direction)
    assert abs(res.clean_value - res.corrupt_value) < 1e-5                 # the same input twice: 0/0
    assert torch.isnan(res.normalised).all() and torch.isfinite(res.value).all()
    assert res.reason == [[PT.EQUAL_RUNS] * 2] * 2 and any("0/0" in n for n in res.notes)
    frame = res.to_frame(metrics=["normalised"])
    assert frame["value"].isna().all() and set(frame["reason"]) == {PT.EQUAL_RUNS}
    assert no_hooks(model)


def test_normalised_is_nan_with_a_reason_at_a_layer_with_no_anchors():
    model, p = tiny(), prompt()
    with model.hooks(fwd_hooks=PATCH_RIG + [("blocks.1.attn.hook_attn_scores", flat)]):
        res = PT.patch_anchor_activations(model, p, corrupt(p), step=0, component="resid_pre")
    assert res.n_positions[:, 1].tolist() == [0.0, 0.0]                    # layer 1: no anchors, no random keys
    assert torch.isnan(res.normalised[:, 1]).all()
    assert abs(float(res.normalised[0, 0])) < 1e-4                         # layer 0 is still measured
    assert [row[1] for row in res.reason] == [PT.NOTHING_PATCHED] * 2 and [row[0] for row in res.reason] == ["", ""]
    frame = res.to_frame(metrics=["normalised"]).set_index(["condition", "layer"])
    assert frame.loc[("anchors", 1), "reason"] == PT.NOTHING_PATCHED and frame.loc[("anchors", 0), "reason"] == ""
    assert no_hooks(model)


def test_normalise_planted_values():
    value = torch.tensor([[2.0, 1.0, 3.0]], dtype=torch.float64)
    norm, reason, notes = PT.normalise(value, 3.0, 1.0, torch.tensor([[1.0, 2.0, 0.0]]), torch.float32)
    assert norm[0, :2].tolist() == [0.5, 0.0] and math.isnan(float(norm[0, 2]))
    assert reason == [["", "", PT.NOTHING_PATCHED]] and len(notes) == 1
    # a difference far below float32's precision of the metric is 0/0, one above it is a number
    tiny_gap, _, _ = PT.normalise(value, 3.0 + 1e-9, 3.0, torch.ones(1, 3), torch.float32)
    assert torch.isnan(tiny_gap).all()
    real_gap, _, _ = PT.normalise(value, 3.0 + 1e-9, 3.0, torch.ones(1, 3), torch.float64)
    assert torch.isfinite(real_gap).all()
