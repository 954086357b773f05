"""GIDD-DiT (mdm_lens.ddit.gidd / diffusion.gidd): hub-layout loading (no prefix, persistent rotary tables),
logits exact against the DDiT reference transcription conditioned on t, its parameterisation, the hybrid noise on
planted values, the conditioning hook, and the sampler token-exact against a transcription of `GiddSampler`."""

from __future__ import annotations

import math

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.ddit.gidd import HookedGIDD, HybridNoise
from mdm_lens.errors import ArgumentError, CheckpointError, InputError
from tests.families.bd3gidd_checkpoints import GIDD_CONFIG, write_gidd
from tests.families.bd3gidd_reference import reference_gidd_sample
from tests.families.ddit_reference import reference_forward

MASK, L = 58, 12


@pytest.fixture(scope="module")
def gidd(tmp_path_factory):
    folder, sd = write_gidd(tmp_path_factory.mktemp("gidd"), seed=2)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


def _ref_sd(sd):
    hd = 16
    return dict(sd, **{"backbone.rotary_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))})


def test_config_values_are_read(gidd):
    model, _ = gidd
    assert isinstance(model, HookedGIDD)
    c = model.cfg
    assert (c.family, c.d_vocab, c.n_ctx, c.d_model, c.n_layers, c.n_heads, c.mask_token_id) == \
        ("gidd", 59, 12, 32, 2, 2, 58)
    assert c.extra["cond_dim"] == 20 and c.extra["p_uniform"] == 0.1 and c.extra["time_conditioning"] is True


def test_logits_match_the_reference_at_max_seq_len(gidd):
    model, sd = gidd
    z = torch.randint(0, 59, (3, L), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.05, 0.5, 0.97])
    ref = reference_forward(_ref_sd(sd), 2, z, t)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(model(z, sigma=t), ref, atol=1e-4 * float(ref.abs().max()), rtol=0)
    lp = model(z, sigma=t, return_type="log_probs")
    assert float(lp[..., MASK].max()) < -1e5
    want = ref.clone()
    want[..., MASK] = -1e6
    torch.testing.assert_close(lp, want.log_softmax(-1), atol=1e-4, rtol=0)


def test_the_time_changes_the_output_and_the_hook_edits_it_exactly(gidd):
    model, _ = gidd
    z = torch.randint(0, 59, (2, L), generator=torch.Generator().manual_seed(1))
    want = model(z, sigma=0.8)
    assert (model(z, sigma=0.1) - want).abs().max() > 1e-2
    got = model.run_with_hooks(z, sigma=0.1, fwd_hooks=[("hook_sigma", lambda s, hook: torch.full_like(s, 0.8))])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_forward_without_t_outside_a_step_is_at_the_clean_time_t_eps(gidd):
    """The probes' clean forwards of a final sequence take t = t_eps (the sampler's last grid time), read from the
    config: set to 0.3 here so that it is visibly not t = 0 (and restored)."""
    model, _ = gidd
    z = torch.arange(L).remainder(model.cfg.d_vocab - 1)[None]
    old = model.cfg.extra["t_eps"]
    try:
        model.cfg.extra["t_eps"] = 0.3
        torch.testing.assert_close(model(z), model(z, sigma=0.3), atol=0, rtol=0)
        assert (model(z) - model(z, sigma=0.0)).abs().max() > 1e-3
        assert model.step_sigma() == 0.3
    finally:
        model.cfg.extra["t_eps"] = old


def test_forward_refusals(gidd):
    model, _ = gidd
    z = torch.zeros(1, L, dtype=torch.long)
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        model(z, sigma=1.5)
    with pytest.raises(ArgumentError, match="subs"):
        model(z, sigma=0.5, return_type="subs")


def test_wrong_rotary_tables_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = write_gidd(tmp_path, seed=0)
    sd = load_file(str(folder / "model.safetensors"))
    sd["rotary_emb.cos_cached"] = sd["rotary_emb.cos_cached"].flip(1).contiguous()
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="cos_cached"):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_hybrid_noise_planted_values():
    noise = HybridNoise(5, 4, 0.1)
    b = 2 * 0.1 / 0.9  # B = 2^γ · p_u / (1 − p_u), γ = 1
    alpha, betapi = noise.alpha_betapi(torch.tensor([0.5]))
    c = b * 0.5
    assert float(alpha) == pytest.approx(0.5 / (1 + c), rel=1e-6)
    assert float(betapi[0, 4]) == pytest.approx(0.5 / (1 + c), rel=1e-6)  # the mask's share t / C_t
    assert float(betapi[0, 0]) == pytest.approx(c / 4 / (1 + c), rel=1e-6)  # uniform over the 4 other ids
    for t in (0.0, 0.3, 1.0):
        a, bp = noise.alpha_betapi(torch.tensor([t]))
        assert float(a + bp.sum()) == pytest.approx(1.0, abs=1e-6)
    # p_uniform 0 → the floor p_u = e^−20: log B = ln 2 − 20 (above the −20 clip), so c_t is tiny, not 0
    assert math.isclose(float(HybridNoise(5, 4, 0.0).log_b), math.log(2) - 20, rel_tol=1e-6)


@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_sampler_is_token_exact(gidd, min_p):
    model, sd = gidd
    prompt = torch.tensor([[3, 4], [5, 6]])
    out = model.generate(prompt, gen_length=10, steps=7, min_p=min_p, seed=4)
    torch.manual_seed(4)
    z = torch.cat([prompt, torch.full((2, 10), MASK)], 1)
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[:, :2] = True
    ref = reference_gidd_sample(sd, 2, z, 7, MASK, 0.1, min_p=min_p, keep=keep)
    assert torch.equal(out.tokens, ref)


def test_sampler_steps_carry_t_descending(gidd):
    model, _ = gidd
    ts = []
    model.generate(torch.tensor([[3, 4]]), gen_length=10, steps=5, seed=0,
                   fwd_hooks=[("hook_sigma", lambda s, hook: ts.append(float(s[0])))])
    grid = [(1 - 2e-4) * k / 5 + 1e-4 for k in (4, 3, 2, 1, 0)]
    assert ts == pytest.approx(grid, abs=1e-6)


def test_a_min_p_that_leaves_no_candidate_is_refused(gidd):
    # a posterior whose largest entry is below min_p renormalises 0/0 in the reference (a garbage draw): refused,
    # naming the step and position; a min_p at that largest probability keeps the argmax and runs
    from mdm_lens.errors import NonFiniteError

    model, _ = gidd
    with pytest.raises(NonFiniteError, match="left no candidate at step 0") as err:
        model.generate(torch.tensor([[3, 4]]), gen_length=10, steps=7, min_p=0.999, seed=4)
    assert err.value.argument == "min_p"
    assert model.generate(torch.tensor([[3, 4]]), gen_length=10, steps=7, min_p=0.05, seed=4).tokens.shape == (1, 12)
