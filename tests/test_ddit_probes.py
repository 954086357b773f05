"""The diffusion machinery and the probes on the DDiT models (MDLM, Duo): replay, step hooks, reducers, the
trajectory cache, σ per step, nnsight's `tracer.iter[k]`, σ patching, the readout behind the lenses and the
knockout scorer, uniform-state "masked" positions, and `mdm-lens sweep` + report on tiny hub-layout checkpoints."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, at_steps, steps
from mdm_lens.errors import InputError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.hooks.runner import StepRunner
from mdm_lens.probes import patching
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit

PROMPT = torch.tensor([[5, 9, 2], [7, 1, 30]])
RUN = dict(steps=5, gen_length=10, seed=3)


def _load(tmp_path_factory, config, seed):
    folder, _ = write_ddit(tmp_path_factory.mktemp(config["model_type"]), config, seed=seed)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"duo": _load(tmp_path_factory, DUO_CONFIG, 12),
            "mdlm_tc": _load(tmp_path_factory, dict(MDLM_CONFIG, time_conditioning=True), 13),
            "mdlm": _load(tmp_path_factory, MDLM_CONFIG, 11)}


def _recorded(model, monkeypatch, **kw):
    seen, inner = [], StepRunner.forward

    def forward(self, state, tokens, **kwargs):
        logits = inner(self, state, tokens, **kwargs)
        seen.append((state, tokens.clone(), logits.clone()))
        return logits

    monkeypatch.setattr(StepRunner, "forward", forward)
    try:
        out = model.generate(PROMPT, **kw)
    finally:
        monkeypatch.setattr(StepRunner, "forward", inner)
    return out, seen


@pytest.mark.parametrize("name, kw", [("duo", dict(noise_removal="greedy")), ("duo", {}),
                                      ("mdlm_tc", dict(predictor="analytic")), ("mdlm_tc", {})])
def test_replay_is_the_forward_the_sampler_ran_with_its_sigma(models, monkeypatch, name, kw):
    model = models[name]
    out, seen = _recorded(model, monkeypatch, **RUN, **kw)
    assert len(seen) == out.n_steps == 6
    sigmas = []
    for k, (state, tokens, logits) in enumerate(seen):
        assert state.step == k
        again = out.state_at(k)
        torch.testing.assert_close(again.extra["sigma"], state.extra["sigma"], rtol=0, atol=0)
        torch.testing.assert_close(again.extra["t"], state.extra["t"], rtol=0, atol=0)
        assert torch.equal(again.masked, state.masked) and torch.equal(again.x, tokens)
        replayed = out.replay(model, k)
        scale = float(logits.abs().max())
        torch.testing.assert_close(replayed, logits, rtol=0, atol=1e-5 * scale)
        sigmas.append(float(state.extra["sigma"][0]))
    # σ falls along the run: the conditioning is not a constant
    assert sigmas == sorted(sigmas, reverse=True) and sigmas[0] > 5 * sigmas[-2]
    # a replay's σ matters: step 0 replayed with step 3's σ differs from step 0 (time-conditioned models)
    assert (out.replay(model, 0) - patching.sigma_patch(model, out, 0, 3)).abs().max() > 1e-3


def test_masked_means_mask_ids_on_mdlm_and_generated_positions_on_duo(models, monkeypatch):
    out, seen = _recorded(models["duo"], monkeypatch, **RUN)
    gen = torch.zeros(2, 13, dtype=torch.bool)
    gen[:, 3:] = True
    assert all(torch.equal(s.masked, gen) for s, _, _ in seen)  # every generated position, at every step
    out, seen = _recorded(models["mdlm"], monkeypatch, steps=5, gen_length=10, seed=3, predictor="ddpm")
    for s, tokens, _ in seen:
        assert torch.equal(s.masked, tokens == 60)
    assert int(seen[0][0].masked.sum()) == 20 and int(seen[-1][0].masked.sum()) < 20


def test_step_hooks_fire_at_their_steps_with_the_step_state(models):
    model = models["duo"]
    got = []

    def fn(t, hook):
        got.append((model.state.step, float(t[0]), float(model.state.extra["sigma"][0])))

    out = model.generate(PROMPT, fwd_hooks=[("hook_sigma", at_steps(fn, [1, -1]))], **RUN)
    assert [g[0] for g in got] == [1, 5]
    assert all(a == b for _, a, b in got)  # the hook sees the σ the state carries
    ts = torch.linspace(1, 1e-5, 6)
    assert got[0][1] == pytest.approx(float(-torch.log(1 - (1 - 1e-3) * ts[1])), rel=1e-6)
    assert out.n_steps == 6


def test_received_attention_reducer_equals_the_cached_patterns(models):
    model = models["duo"]
    out = model.generate(PROMPT, record=[ReceivedAttention()], cache="blocks.*.attn.hook_pattern", **RUN)
    rec = out.records["received_attention"]                         # [step, batch, layer, head, key]
    assert rec.shape == (6, 2, 2, 2, 13)
    for k in range(6):
        for layer in range(2):
            pattern = out.cache[k][f"blocks.{layer}.attn.hook_pattern"]  # [batch, head, query, key]
            torch.testing.assert_close(rec[k, :, layer], pattern.mean(-2).cpu(), rtol=0, atol=1e-6)
    stacked = out.cache.stack("blocks.1.attn.hook_pattern")
    assert stacked.shape == (6, 2, 2, 13, 13)
    torch.testing.assert_close(stacked[4], out.cache[4]["blocks.1.attn.hook_pattern"])


def test_ddpm_cache_steps_without_a_forward_record_nothing(models):
    model = models["mdlm"]
    fired = []
    out = model.generate(PROMPT[:1], steps=30, gen_length=6, seed=1, record=[ReceivedAttention()],
                         fwd_hooks=[("hook_sigma", lambda t, hook: fired.append(model.state.step))])
    rec = out.records["received_attention"]
    # a step that reused the cached p_x0 ran no forward: the reducer has a row only for the steps that ran
    assert 0 < len(fired) < 31 == out.n_steps and fired[-1] == 30
    assert rec.shape[0] == len(fired) and out.record_meta["received_attention"]["steps"] == fired
    assert bool(torch.isfinite(rec).all())


def test_sigma_patch_equals_the_forward_at_the_source_sigma(models):
    for name in ("duo", "mdlm_tc"):
        model = models[name]
        out = model.generate(PROMPT, **RUN)
        x3, sigma1 = out.trajectory.x_steps[3], out.state_at(1).extra["sigma"]
        patched = patching.sigma_patch(model, out, 3, 1)
        torch.testing.assert_close(patched, model(x3, sigma=sigma1), rtol=0, atol=0)
        assert (patched - out.replay(model, 3)).abs().max() > 1e-3
        # the hook_cond recipe gives the same logits
        with out.at_step(model, 1) as (x1, kw):
            _, cache = model.run_with_cache(x1, names_filter="hook_cond")
        recipe = out.replay(model, 3, fwd_hooks=[("hook_cond", lambda t, hook: cache["hook_cond"])])
        torch.testing.assert_close(recipe, patched, rtol=0, atol=0)
    with pytest.raises(InputError, match="not time-conditioned"):
        patching.sigma_patch(models["mdlm"], models["mdlm"].generate(PROMPT, **RUN), 1, 0)


def test_forwards_without_sigma_read_the_step_state_or_the_clean_sigma(models):
    model = models["duo"]
    out = model.generate(PROMPT, **RUN)
    with out.at_step(model, 2) as (x, kw):
        inside = model(x, **kw)
    torch.testing.assert_close(inside, model(x, sigma=out.state_at(2).extra["sigma"]), rtol=0, atol=0)
    assert model.state is None
    clean = -torch.log1p(torch.tensor(-(1 - 1e-3) * 1e-5))
    torch.testing.assert_close(model(x), model(x, sigma=clean), rtol=0, atol=0)


def test_readout_is_the_models_own_logits_and_the_lens_reads_it(models):
    from mdm_lens.lens import lens_logits
    from mdm_lens.probes._knockout_hooks import readout, readout_hook

    model = models["duo"]
    out = model.generate(PROMPT, **RUN)
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    with out.at_step(model, 2) as (x, kw):
        logits, cache = model.run_with_cache(x, names_filter=[last, readout_hook(model)])
        lensed = lens_logits(model, cache[last], model.cfg.n_layers - 1)
    scale = float(logits.detach().abs().max())
    torch.testing.assert_close(lensed, logits, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(readout(model, cache[readout_hook(model)]), logits, rtol=0, atol=1e-5 * scale)
    # outside the step the lens would read the clean σ: a different readout (σ matters at the final adaLN)
    assert (lens_logits(model, cache[last], model.cfg.n_layers - 1) - logits).abs().max() > 1e-3


def test_nnsight_iter_k_is_denoising_step_k(models):
    pytest.importorskip("nnsight")
    from mdm_lens.nnsight import DiffusionLM

    for name in ("duo", "mdlm_tc"):
        model = models[name]
        lm = DiffusionLM(model)
        got, sig = [], []
        with lm.generate(PROMPT, **RUN) as tracer:
            for _ in tracer.iter[[1, 4]]:
                sig.append(lm.hook_sigma.output.save())
                got.append(lm.blocks[1].attn.hook_pattern.output.save())
        ref = model.generate(PROMPT, cache=["blocks.1.attn.hook_pattern"] @ steps(1, 4), **RUN)
        for i, k in enumerate([1, 4]):
            assert torch.equal(got[i], ref.cache[k]["blocks.1.attn.hook_pattern"])
            torch.testing.assert_close(sig[i], ref.state_at(k).extra["sigma"], rtol=0, atol=0)


def test_uniform_state_probes_say_what_masked_means(models):
    from mdm_lens.noisy import UNIFORM_STATE_NOTE, noisy_positions, notes_for

    duo, mdlm = models["duo"], models["mdlm"]
    x = torch.tensor([[4, 60, 7, 60]])
    assert noisy_positions(duo.cfg, x, 1).tolist() == [[False, True, True, True]]
    assert noisy_positions(mdlm.cfg, x, 1).tolist() == [[False, True, False, True]]
    assert notes_for(duo.cfg) == [UNIFORM_STATE_NOTE] and notes_for(mdlm.cfg) == []
    out = duo.generate(PROMPT, **RUN)
    res = patching.knockout(duo, PROMPT[:1], steps=[1], layers=[0], n_random=0, gen_length=10, n_steps=5)
    assert res.notes[0] == UNIFORM_STATE_NOTE
    assert UNIFORM_STATE_NOTE not in patching.knockout(mdlm, PROMPT[:1], steps=[1], layers=[0], n_random=0, n_steps=5,
                                                       gen_length=10).notes
    from mdm_lens.probes.attribution import attribution_patching

    atp = attribution_patching(duo, out, torch.tensor([[6, 6, 6], [8, 8, 8]]), steps=[1])
    assert atp.notes == [UNIFORM_STATE_NOTE] and atp.to_frame().shape[0] > 0
    pair = patching.matched_canvases(out, torch.tensor([[6, 6, 6], [8, 8, 8]]), step=2, model=duo)
    assert torch.equal(pair.masked, noisy_positions(duo.cfg, pair.clean, 3))
    torch.testing.assert_close(pair.forward_kwargs["sigma"], out.state_at(2).extra["sigma"])


def test_sae_export_reads_mask_positions_on_mdlm_and_generated_positions_on_duo(models, tmp_path):
    pytest.importorskip("datasets")
    import numpy as np

    from mdm_lens.sae import export_activations

    prompts = [[5, 9, 2], [7, 1, 30, 4], [3, 3, 8]]
    for name in ("duo", "mdlm"):
        ds = export_activations(models[name], prompts, ["blocks.1.hook_resid_post"], out=tmp_path / name,
                                steps=[0], positions="masked", n_steps=4, gen_length=6, seed=1, progress=False)
        cols = ds.with_format("numpy")
        pos, step = np.asarray(cols["position"]), np.asarray(cols["step"])
        # step 0: every generated position is noisy on both (all masks / all uniform noise): 3 items × 6
        assert len(ds) == 18 and set(step.tolist()) == {0}
        lengths = {"0": 3, "1": 4, "2": 3}
        items = np.asarray(cols["item_id"]).tolist()
        assert all(p >= lengths[str(i)] for p, i in zip(pos.tolist(), items))
        act = np.asarray(cols["blocks.1.hook_resid_post"])
        assert act.shape[-1] == models[name].cfg.d_model and np.isfinite(act).all()
