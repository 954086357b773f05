"""knockout on DiffusionGemma: the sampled metrics, with canvas queries, a pre-pass of the sampler's own decoder
call for anchors, and gold scores read from transformers' softcapped logits; teacher-forced metrics are NaN."""

from __future__ import annotations

import math

import torch

from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.probes import patching
from mdm_lens.probes.knockout_bd import NOT_APPLICABLE

import pytest


@pytest.fixture(scope="module")
def bridge():
    return TransformersBridge(tiny_diffusion_gemma(seed=0, vocab_size=322, sliding_window=16))


def _prompt():
    return torch.randint(2, 300, (1, 10), generator=torch.Generator().manual_seed(3))


def test_final_logits_are_transformers_logits(bridge):
    ids, canvas = _prompt(), torch.randint(2, 300, (1, 8), generator=torch.Generator().manual_seed(4))
    seen = []
    with torch.no_grad():
        logits = bridge.run_with_hooks(ids, decoder_input_ids=canvas,
                                       fwd_hooks=[("ln_final.hook_out", lambda x, hook: seen.append(x))])
        assert torch.equal(bridge.final_logits(seen[0]), logits)


def test_clean_run_scores_its_own_answer_and_a_cut_prompt_moves_it(bridge):
    res = patching.knockout(bridge, _prompt(), targets=list(range(10)), queries="all", n_random=1, gen_length=8,
                            n_steps=4)
    t = res.table()
    assert res.conditions == ["clean", "targets", "random"]
    # the gold is the clean run's own answer: accepted tokens are the argmax there, and it matches itself
    assert t.loc["clean", "answer_rank"] == 0.0 and t.loc["clean", "exact_match"] == 1.0
    assert t.loc["clean", "agreement"] == 1.0 and torch.all(res.n_targets[0] == 0)
    # every canvas row loses the whole prompt at every step: the answer moves and its log-prob drops
    assert t.loc["targets", "agreement"] < 1.0 and res.effect[1] < 0
    assert torch.all(res.n_targets[1] > 0)
    assert math.isnan(t.loc["clean", "tf_answer_logprob_mean"]) and res.notes == [NOT_APPLICABLE]


def test_anchor_knockout_detects_on_a_pre_pass_and_matches_the_random_control_per_forward(bridge, monkeypatch):
    """The random control is matched per forward and layer: as many random visible non-anchor keys as that
    forward's pre-pass found anchors (fewer only when fewer exist, counted as `unmatched`). Its own trajectory
    diverges from the anchor run's, so its counts are compared with its own pre-pass, not the anchor run's."""
    from mdm_lens.probes import _causal as C

    calls, real = [], C.random_like

    def spy(anchors, visible, gen):
        out = real(anchors, visible, gen)
        calls.append((anchors.clone(), visible.clone(), out.clone()))
        return out

    monkeypatch.setattr(C, "random_like", spy)
    res = patching.knockout(bridge, _prompt(), n_random=1, gen_length=8, n_steps=4, layers=[1, 2])
    assert res.conditions == ["clean", "anchors", "random"]
    assert res.n_targets[1].sum() > 0                          # the pre-pass found anchors (zscore: not every step)
    assert calls and any(bool(a.any()) for a, _, _ in calls)
    short = 0
    for anchors, visible, out in calls:
        assert not bool((out & ~(visible & ~anchors)).any())   # only visible keys that are not anchors
        want = torch.minimum(anchors.sum(-1), (visible & ~anchors).sum(-1))
        assert torch.equal(out.sum(-1), want)                   # exactly as many, or every candidate
        short += int(bool((want < anchors.sum(-1)).any()))
    # the random condition's note says how many (forward, layer) cuts were smaller than the anchors they control
    note = res.condition_notes[2]
    assert (f"unmatched control: at {short:g} " in note) if short else "unmatched" not in note
    assert torch.isfinite(res.answer_logprob).all() and torch.isfinite(res.value).all()
    # hooks are gone afterwards: a plain generate is the clean run again
    out = bridge.generate(_prompt(), gen_length=8, steps=4)
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())
    assert out.tokens.shape[1] == 18


def test_knockout_hooks_outside_generate_say_where_they_run(bridge):
    from mdm_lens.errors import InputError
    from mdm_lens.probes.knockout import KnockoutHooks

    ko = KnockoutHooks(bridge, [1], targets=[0, 1])
    canvas = torch.randint(2, 300, (1, 8), generator=torch.Generator().manual_seed(5))
    with pytest.raises(InputError, match="inside its generate"):
        bridge.run_with_hooks(_prompt(), decoder_input_ids=canvas, fwd_hooks=ko.hooks())
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())
