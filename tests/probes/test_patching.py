"""Knockout and activation patching on a planted anchor (spec §2.8–2.10).

Rig (hooks on a tiny random MDM, layer 0 only): +20 on the pre-softmax score of key A for every query
(``hook_attn_scores``), so A takes ~all of layer 0's attention, and a value vector at A that decides the
canvas logits — either a fixed large V* (knockout) or the token's own value rescaled to norm 30
(patching, so the value depends on which token sits at A).  Known answers: knocking A out changes the
output, knocking out as many random keys does not; patching the corrupted token's layer-0 residual or
value at A reproduces the corrupted run (normalised 0), patching random positions or keys does not.
"""

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
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
    assert torch.allclose(norm[1], torch.ones(2, dtype=torch.float64))     # random positions: no effect
    assert res.n_positions[0, 0] == 1 and res.n_positions[1, 0] == 1
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
