"""MDLM and Duo samplers token-exact against transcriptions of the reference loops (same seed, same draws)."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import SamplerConfigError
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit
from tests.families.ddit_reference import reference_duo_sample, reference_mdlm_sample


def _load(tmp_path_factory, config, seed, **changes):
    folder, sd = write_ddit(tmp_path_factory.mktemp("m"), dict(config, **changes), seed=seed)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


@pytest.fixture(scope="module")
def mdlm(tmp_path_factory):
    return _load(tmp_path_factory, MDLM_CONFIG, 11)


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    return _load(tmp_path_factory, DUO_CONFIG, 12)


PROMPT = torch.tensor([[5, 9, 2], [7, 1, 30]])


@pytest.mark.parametrize("predictor", ["ddpm_cache", "ddpm", "analytic"])
@pytest.mark.parametrize("noise_removal", [True, False])
def test_mdlm_sampler_is_token_exact(mdlm, predictor, noise_removal):
    model, sd = mdlm
    out = model.generate(PROMPT, steps=12, gen_length=16, predictor=predictor, noise_removal=noise_removal, seed=3)
    torch.manual_seed(3)
    x0 = torch.cat([PROMPT, torch.full((2, 16), 60)], dim=1)
    ref = reference_mdlm_sample(sd, 4, x0, 60, 12, predictor, noise_removal)
    assert torch.equal(out.tokens, ref)
    assert bool((out.tokens[:, :3] == PROMPT).all())
    if noise_removal:
        assert not bool((out.tokens == 60).any())


def test_mdlm_cache_is_reused_only_when_nothing_changed(mdlm):
    model, _ = mdlm
    seen = []
    model.generate(PROMPT, steps=40, gen_length=8, seed=1,
                   fwd_hooks=[("hook_sigma", lambda t, hook: seen.append(model.state.step))])
    assert 0 < len(seen) < 41 and seen[-1] == 40  # some steps reused the cache; the noise removal ran
    seen.clear()
    model.generate(PROMPT, steps=40, gen_length=8, seed=1, predictor="ddpm",
                   fwd_hooks=[("hook_sigma", lambda t, hook: seen.append(model.state.step))])
    assert seen == list(range(41))


def test_mdlm_time_conditioned_sampler_is_exact(tmp_path_factory):
    model, sd = _load(tmp_path_factory, MDLM_CONFIG, 13, time_conditioning=True)
    out = model.generate(PROMPT[:1], steps=6, gen_length=10, seed=5)
    torch.manual_seed(5)
    x0 = torch.cat([PROMPT[:1], torch.full((1, 10), 60)], dim=1)
    assert torch.equal(out.tokens, reference_mdlm_sample(sd, 4, x0, 60, 6, "ddpm_cache", True, time_conditioning=True))


@pytest.mark.parametrize("noise_removal, use_float64, p_nucleus, steps", [
    ("ancestral", True, 1.0, 10), ("greedy", True, 1.0, 8), (None, False, 1.0, 5), ("ancestral", True, 0.9, 6),
    ("greedy", False, 0.5, 4),
])
def test_duo_sampler_is_token_exact(duo, noise_removal, use_float64, p_nucleus, steps):
    model, sd = duo
    out = model.generate(PROMPT, steps=steps, gen_length=14, noise_removal=noise_removal, use_float64=use_float64,
                         p_nucleus=p_nucleus, seed=4)
    torch.manual_seed(4)
    ref = reference_duo_sample(sd, 2, PROMPT, 14, 53, steps, noise_removal, use_float64, p_nucleus)
    assert torch.equal(out.tokens, ref)
    assert bool((out.tokens[:, :3] == PROMPT).all()) and out.settings["p_nucleus"] == p_nucleus


def test_duo_steps_see_their_sigma(duo):
    model, _ = duo
    sigmas = []
    model.generate(PROMPT[:1], steps=4, gen_length=6, noise_removal="greedy",
                   fwd_hooks=[("hook_sigma", lambda t, hook: sigmas.append(float(t[0])))])
    ts = torch.linspace(1, 1e-5, 5)
    want = [float(-torch.log(1 - (1 - 1e-3) * t)) for t in list(ts[:4]) + [ts[-1]]]
    assert sigmas == pytest.approx(want, rel=1e-6)


def test_sampler_settings_are_checked(mdlm, duo):
    with pytest.raises(SamplerConfigError):
        mdlm[0].generate(PROMPT, predictor="analytic_typo")
    with pytest.raises(SamplerConfigError):
        duo[0].generate(PROMPT, p_nucleus=0.0)
    with pytest.raises(SamplerConfigError):
        duo[0].generate(PROMPT, sampler="mdlm")
    with pytest.raises(SamplerConfigError):
        mdlm[0].generate(PROMPT, gen_length=30)


def test_analytic_step_keeps_unmasked_rows_and_weights_masked_rows_by_the_score():
    from mdm_lens.diffusion.mdlm_analytic import analytic_probs, denoiser_probs

    # planted: vocab 4 (mask 3), one unmasked row (token 1) and one masked row with p = (0.5, 0.3, 0.2)
    log_p = torch.full((1, 2, 4), -1e6)
    log_p[0, 0, 1] = 0
    log_p[0, 1, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    x = torch.tensor([[1, 3]])
    sigma, dsigma = torch.tensor([2.0]), torch.tensor([0.5])
    probs = analytic_probs(log_p, x, sigma, dsigma, 3)
    assert probs[0, 0].tolist() == pytest.approx([0, 1, 0, 0], abs=1e-12)  # an unmasked token never moves
    k = torch.exp(-sigma) / (1 - torch.exp(-sigma))
    # masked row: y ≠ mask gets p·k·e^{dσ}·(1 − e^{−dσ}); the mask keeps e^{dσ} + (1 − e^{dσ})(1 + k)
    want = [float(p * k * torch.exp(dsigma) * (1 - torch.exp(-dsigma))) for p in (0.5, 0.3, 0.2)]
    want.append(float(torch.exp(dsigma) + (1 - torch.exp(dsigma)) * (1 + k)))
    assert probs[0, 1].tolist() == pytest.approx(want, rel=1e-5)
    # the denoiser (dσ = σ) never draws the mask
    assert denoiser_probs(log_p, x, sigma, 3)[..., 3].abs().max() == 0


def test_analytic_predictor_runs_a_forward_every_step_and_matches_ddpm_in_distribution(mdlm):
    from mdm_lens.diffusion.ddit import loglinear_sigma
    from mdm_lens.diffusion.mdlm_analytic import analytic_probs

    model, _ = mdlm
    seen = []
    model.generate(PROMPT, steps=10, gen_length=12, predictor="analytic", seed=2,
                   fwd_hooks=[("hook_sigma", lambda t, hook: seen.append(model.state.step))])
    assert seen == list(range(11))  # no cache: every step and the denoiser run the network
    # for the absorbing state the analytic categorical is proportional to ddpm's q (row by row)
    x = torch.cat([PROMPT, torch.full((2, 12), 60)], dim=1)
    log_p = model(x, return_type="log_probs")
    t, s = torch.tensor([0.7, 0.7]), torch.tensor([0.6, 0.6])
    st, ss = loglinear_sigma(t), loglinear_sigma(s)
    probs = analytic_probs(log_p, x, st, st - ss, 60)[:, 3:]
    q = log_p.exp()[:, 3:] * (torch.exp(-ss) - torch.exp(-st))[:, None, None]
    q[..., 60] = (1 - torch.exp(-ss))[:, None]
    ratio = probs / q
    assert torch.allclose(ratio, ratio[..., :1], rtol=1e-4)
