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


@pytest.mark.parametrize("predictor", ["ddpm_cache", "ddpm"])
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
