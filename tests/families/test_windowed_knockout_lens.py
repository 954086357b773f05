"""Knockout and the lens over steps on the samplers whose forwards no replay rebuilds: Nemotron-Labs-Diffusion
(`sampler="nemotron"`: causal prefill / commit forwards around each block's denoising windows) and BD3LM (one block
against the stored ones; `kv_cache=True` adds a storing forward per block). Both are read from the run itself:
`mdm_lens.probes.knockout_windowed` and `mdm_lens.lens.run_only`.

Checkpoints: the family writers (nemotron_fixture: YaRN, GQA, head_dim != hidden / heads, log-normal norms; BD3LM
time-conditioned, block_size 4, sampling eps 0.05 / 0.8 — none of them the defaults)."""

from __future__ import annotations

import math

import pytest
import torch
from bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm
from nemotron_fixture import write_nemotron

from mdm_lens import HookedMDM
from mdm_lens.diffusion.own_forwards import is_denoising_forward, step_notes
from mdm_lens.errors import InputError
from mdm_lens.lens import lens_trace
from mdm_lens.probes.knockout_windowed import ForwardSteps, not_applicable
from mdm_lens.probes.patching import knockout

NEMOTRON = dict(sampler="nemotron", gen_length=8, block_length=4, seed=0)
BD3 = dict(gen_length=9, n_steps=4, seed=0)   # prompt 3 + 9 = 3 blocks of 4; 4 steps per block: every mask commits
RUNS = {"nemotron": NEMOTRON, "bd3lm": dict(BD3, kv_cache=False), "bd3lm_kv": dict(BD3, kv_cache=True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    nem = HookedMDM.from_pretrained(str(write_nemotron(tmp_path_factory.mktemp("nem"))[0]), load_tokenizer=False)
    bd3 = write_bd3lm(tmp_path_factory.mktemp("bd3"), dict(BD3LM_CONFIG, time_conditioning=True), seed=1)[0]
    return {"nemotron": nem, "bd3lm": HookedMDM.from_pretrained(str(bd3), load_tokenizer=False)}


def _setup(models, run):
    model = models["nemotron" if run == "nemotron" else "bd3lm"]
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 90 if run == "nemotron" else 50, (1, 5 if run == "nemotron" else 3), generator=g)
    return model, prompt, dict(RUNS[run])


def _gen_kwargs(kw):
    kw = dict(kw)
    if "n_steps" in kw:
        kw["steps"] = kw.pop("n_steps")
    return kw


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("run", list(RUNS))
def test_a_knockout_of_no_key_equals_clean_exactly(models, run):
    model, prompt, kw = _setup(models, run)
    res = knockout(model, prompt, targets=[], n_random=1, **kw)
    assert res.conditions == ["clean", "targets", "random"]
    for name in ("value", "answer_logprob", "answer_rank", "exact_match", "agreement", "accuracy"):
        for k in (1, 2):
            _same(getattr(res, name)[k], getattr(res, name)[0])
    assert math.isfinite(float(res.answer_logprob[0])) and float(res.exact_match[0]) == 1.0
    assert float(res.agreement[0]) == 1.0 and torch.equal(res.effect, torch.zeros(3, dtype=torch.float64))
    for name in ("tf_answer_logprob", "tf_answer_rank", "step_metric", "metric_mean"):
        assert torch.isnan(getattr(res, name)).all(), name
    sampler = "nemotron" if run == "nemotron" else "bd3lm"
    assert not_applicable(sampler, kw) in res.notes
    assert float(res.forwards_cut[0]) == 0  # clean cuts nothing


@pytest.mark.parametrize("run", list(RUNS))
def test_cutting_every_visible_key_but_one_changes_the_answer(models, run):
    model, prompt, kw = _setup(models, run)
    P = prompt.shape[1]
    keep = P - 1  # the prompt's last token: visible to every query row of every forward
    res = knockout(model, prompt, targets=[p for p in range(P + kw["gen_length"]) if p != keep], n_random=0, **kw)
    clean, cut = float(res.answer_logprob[0]), float(res.answer_logprob[1])
    assert math.isfinite(clean) and math.isfinite(cut)
    assert abs(cut - clean) > 0.5
    out = model.generate(prompt, **_gen_kwargs(kw))
    n_denoising = out.n_steps - len(step_notes(out))
    assert float(res.forwards_cut[1]) == n_denoising  # steps=None: every denoising forward, no other
    assert (res.n_targets[1, :n_denoising] > 0).all()


@pytest.mark.parametrize("run, expected", [("nemotron", [1, 3, 6]), ("bd3lm_kv", None)])
def test_steps_k_are_the_kth_denoising_forwards(models, run, expected):
    model, prompt, kw = _setup(models, run)
    out = model.generate(prompt, **_gen_kwargs(kw))
    notes = step_notes(out)
    denoising = [s for s in range(out.n_steps) if s not in notes]
    if expected is None:  # bd3lm kv_cache: one storing forward per finished block, between its denoising forwards
        assert len(notes) == 3
        expected = [denoising[k] for k in (0, 2, 4)]
    gate, fired = ForwardSteps(model, [0, 2, 4]), []
    model.generate(prompt, fwd_hooks=[("hook_embed", gate.gate(lambda x, hook: fired.append(model.state.step)))],
                   **_gen_kwargs(kw))
    assert fired == expected and [gate.ordinal_of[s] for s in fired] == [0, 2, 4]
    res = knockout(model, prompt, steps=[0, 2, 4], targets=[0], n_random=1, **kw)
    assert res.steps == [0, 2, 4] and res.forwards_cut.tolist() == [0.0, 3.0, 3.0]
    assert (res.n_targets[1] == 1).all()  # position 0 is a key of every denoising forward
    assert (res.n_targets[0] == 0).all()  # clean reached the same forwards and cut nothing there: 0, not NaN


@pytest.mark.parametrize("run, extra", [("nemotron", {}), ("bd3lm", dict(nucleus_p=1e-9)),
                                        ("bd3lm_kv", dict(nucleus_p=1e-9))])
def test_greedy_clean_answers_are_their_forwards_argmax(models, run, extra):
    """The scorer reads each answer position's logits at the forward that committed it: a greedy run committed the
    argmax there, so every rank is exactly 0 (a row off by one, or a seed read from a block row, would not be)."""
    model, prompt, kw = _setup(models, run)
    res = knockout(model, prompt, targets=[0], n_random=0, **kw, **extra)
    assert float(res.answer_rank[0]) == 0.0 and float(res.answer_logprob[0]) < 0


def _forward_logits(model, prompt, kw):
    """Each denoising forward's returned logits, by run step, with the canvas positions of its rows."""
    seen = {}

    def grab(module, args, kwargs, output):
        st = model.state
        if is_denoising_forward(st) and kwargs.get("return_type") == "aligned":
            seen[st.step] = (st.rows, output.detach().double())

    handle = model.register_forward_hook(grab, with_kwargs=True)
    try:
        out = model.generate(prompt, cache=["blocks.*.hook_resid_post", "hook_sigma"] if run_is_ddit(model) else
                             "blocks.*.hook_resid_post", **_gen_kwargs(kw))
    finally:
        handle.remove()
    return out, seen


def run_is_ddit(model):
    return callable(getattr(model, "readout", None))


@pytest.mark.parametrize("run", list(RUNS))
def test_lens_at_the_last_layer_is_the_forward_own_logits(models, run):
    model, prompt, kw = _setup(models, run)
    out, seen = _forward_logits(model, prompt, kw)
    tr = lens_trace(model, out)
    notes = step_notes(out)
    assert set(tr.meta["step_notes"]) == set(notes) and len(notes) == (3 if run != "bd3lm" else 0)
    P = out.prompt_length
    n_checked = 0
    for i, s in enumerate(tr.steps):
        fp, top1 = tr.final_prob[i, -1, 0], tr.top1[i, -1, 0]
        if s in notes:
            assert torch.isnan(fp).all() and (top1 == -1).all() and (tr.final_rank[i, -1, 0] == -1).all()
            continue
        rows, logits = seen[s]
        for j, p in enumerate(tr.positions):
            pos = P + p
            if not rows.start <= pos < rows.stop:
                assert math.isnan(float(fp[j])) and int(top1[j]) == -1
                continue
            probs = logits[0, pos - rows.start].softmax(-1)
            assert abs(float(fp[j]) - float(probs[out.tokens[0, pos]])) < 1e-5
            assert int(top1[j]) == int(probs.argmax())
            n_checked += 1
    assert n_checked >= 12


def test_lens_needs_the_run_cache(models):
    model, prompt, kw = _setup(models, "nemotron")
    out = model.generate(prompt, **kw)
    with pytest.raises(InputError, match=r"cache='blocks\.\*\.hook_resid_post'") as e:
        lens_trace(model, out)
    assert e.value.argument == "out"
    cached = model.generate(prompt, cache="blocks.*.hook_resid_post", **kw)
    with pytest.raises(InputError, match="not implemented over replays") as e:
        lens_trace(model, cached, source="replay")
    assert e.value.argument == "source"
