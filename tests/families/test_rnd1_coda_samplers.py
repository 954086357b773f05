"""The `rnd1` and `coda` samplers are token-exact, with the same seed, against transcriptions of the references'
samplers (rnd1_coda_samplers_reference.py) driven by the plain-torch reference forwards (rnd1_coda_reference.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import SamplerConfigError
from mdm_lens.loading.rnd1 import ReferenceConfigWarning
from rnd1_coda_checkpoints import write_coda, write_rnd1
from rnd1_coda_reference import coda_forward, rnd1_forward
from rnd1_coda_samplers_reference import coda_sample, rnd1_diffusion_sample

PROMPT = torch.tensor([[5, 17, 3, 42, 8]])


@pytest.fixture(scope="module")
def rnd1(tmp_path_factory):
    folder, config, sd = write_rnd1(tmp_path_factory.mktemp("rnd1") / "m", seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceConfigWarning)
        model = HookedMDM.from_pretrained(folder)
    sd64 = {k: v.double() for k, v in sd.items()}
    return model.to(torch.float64), lambda t: rnd1_forward(sd64, config, t)


@pytest.fixture(scope="module")
def coda(tmp_path_factory):
    folder, config, sd = write_coda(tmp_path_factory.mktemp("coda") / "m", seed=5)
    sd64 = {k: v.double() for k, v in sd.items()}
    return HookedMDM.from_pretrained(folder).to(torch.float64), lambda t: coda_forward(sd64, config, t)


RND1_CASES = [  # (temperature, top_k, top_p, greedy, eb_gamma, add_eos_at_end, steps, gen_length)
    (0.1, None, None, False, None, False, 12, 12),  # the reference defaults
    (1.0, None, None, False, None, False, 5, 12),
    (0.8, 7, 0.9, False, None, True, 6, 9),
    (0.0, None, None, True, None, False, 4, 10),
    (1.0, None, None, False, 0.5, False, 16, 12),  # entropy-bounded
    (0.7, 20, None, True, 2.0, True, 16, 12),
]


@pytest.mark.parametrize("case", RND1_CASES)
def test_rnd1_sampler_matches_the_reference_token_for_token(rnd1, case):
    model, logits_fn = rnd1
    temperature, top_k, top_p, greedy, gamma, eos_end, steps, gen_length = case
    seed = 11
    torch.manual_seed(seed)
    with torch.no_grad():
        expected, forwards = rnd1_diffusion_sample(logits_fn, PROMPT, gen_length, steps, temperature, top_k, top_p,
                                                   greedy, mask_id=100, eos_id=98, pad_id=99,
                                                   add_eos_at_end=eos_end, eb_gamma=gamma)
    out = model.generate(PROMPT, sampler="rnd1", steps=steps, gen_length=gen_length, temperature=temperature,
                         top_k=top_k, top_p=top_p, greedy=greedy, eb_gamma=gamma, add_eos_at_end=eos_end, seed=seed)
    assert torch.equal(out.tokens, expected)
    assert len(out.trajectory.x_steps) == len(forwards)  # the same forwards (early stop included)
    assert int(out.tokens[0, -1]) == (98 if eos_end else 99)  # the reserved slot: EOS or PAD, never generated
    assert not bool((out.tokens == 100).any())


def test_rnd1_runs_are_not_all_alike(rnd1):
    """The planted settings change the tokens (a sampler ignoring them would pass the exactness test less often)."""
    model, _ = rnd1
    a = model.generate(PROMPT, sampler="rnd1", steps=6, gen_length=12, temperature=1.0, seed=1).tokens
    b = model.generate(PROMPT, sampler="rnd1", steps=6, gen_length=12, temperature=1.0, seed=2).tokens
    c = model.generate(PROMPT, sampler="rnd1", steps=6, gen_length=12, greedy=True).tokens
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_rnd1_is_the_default_sampler_and_refuses_batches(rnd1):
    model, _ = rnd1
    out = model.generate(PROMPT, steps=4, gen_length=6, greedy=True)
    assert out.sampler == "rnd1" and out.settings["temperature"] == 0.1 and out.settings["eos_token_id"] == 98
    with pytest.raises(SamplerConfigError, match="one unpadded prompt"):
        model.generate(PROMPT.repeat(2, 1), steps=4, gen_length=6)
    with pytest.raises(SamplerConfigError, match="gen_length"):
        model.generate(PROMPT, steps=1, gen_length=1)
    with pytest.raises(SamplerConfigError, match="eb_gamma"):
        model.generate(PROMPT, steps=4, gen_length=6, eb_gamma=-1.0)


CODA_CASES = [  # (alg, alg_temp, temperature, top_p, top_k, steps)
    ("origin", None, 1.0, 1.0, 50, 8),  # the unset defaults (legacy model-config attributes)
    ("entropy", 0.0, 0.1, 0.9, None, 8),  # the eval harness (diffllm.py)
    ("maskgit_plus", 0.5, 0.7, None, 20, 6),
    ("topk_margin", None, 0.0, None, None, 10),
]


@pytest.mark.parametrize("case", CODA_CASES)
def test_coda_sampler_matches_the_reference_token_for_token(coda, case):
    model, logits_fn = coda
    alg, alg_temp, temperature, top_p, top_k, steps = case
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        expected = coda_sample(logits_fn, PROMPT.clone(), 10, steps, 1e-3, alg, alg_temp, temperature, top_p, top_k,
                               100, g)
    out = model.generate(PROMPT, steps=steps, gen_length=10, alg=alg, alg_temp=alg_temp, temperature=temperature,
                         top_p=top_p, top_k=top_k, seed=3)
    assert out.sampler == "coda"
    assert torch.equal(out.tokens, expected)


def test_coda_refuses_padding_and_kv_cache(coda):
    model, _ = coda
    prompts = torch.tensor([[99, 5, 17], [4, 5, 17]])
    with pytest.raises(SamplerConfigError, match="ignores every mask"):
        model.generate(prompts, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), steps=4, gen_length=4)
    with pytest.raises(SamplerConfigError, match="kv_cache"):
        model.generate(PROMPT, steps=4, gen_length=4, kv_cache="prefix", block_length=4)
