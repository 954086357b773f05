"""`generate(sampler="diffusion_gemma")` runs transformers' DiffusionGemma sampler step by step:
token-exact against transformers' `generate` (same seed, same settings), observable per step."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from mdm_lens import ReceivedAttention, TrajectoryCache, at_steps, steps
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import SamplerConfigError

SETTINGS = {
    "defaults_two_canvases": dict(max_new_tokens=16, max_denoising_steps=4),
    "cold_wide_bound": dict(max_new_tokens=24, max_denoising_steps=5, t_min=0.05, t_max=0.1, entropy_bound=2.0),
    "stops_adaptively": dict(max_new_tokens=16, max_denoising_steps=6, stability_threshold=0,
                             confidence_threshold=50.0),
    "eos_ends_early": dict(max_new_tokens=24, max_denoising_steps=3, eos_token_id=list(range(0, 128, 2)),
                           pad_token_id=1),
}


@pytest.fixture(scope="module")
def pair():
    ref = tiny_diffusion_gemma(seed=0)
    return ref, TransformersBridge(copy.deepcopy(ref))


def _reference(ref, ids, seed, attention_mask=None, **kw):
    kw = dict(kw)
    if "entropy_bound" in kw:
        kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=kw.pop("entropy_bound"))
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    torch.manual_seed(seed)
    return ref.generate(ids, **kw)


def _prompt(batch=2, length=5, seed=0):
    return torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_token_exact_against_transformers(pair, name):
    ref, bridge = pair
    ids = _prompt()
    expected = _reference(ref, ids, 11, **SETTINGS[name])
    out = bridge.generate(ids, seed=11, **SETTINGS[name])
    assert torch.equal(out.tokens, expected.sequences)
    assert torch.allclose(out.tokens_per_forward, expected.tokens_per_forward)
    budget = (out.settings["max_new_tokens"] + 7) // 8 * SETTINGS[name]["max_denoising_steps"]
    if name == "stops_adaptively":  # stable (threshold 0) and confident: one step per canvas
        assert out.n_steps == 2 and out.trajectory.block_of_step.tolist() == [0, 1]
    elif name == "eos_ends_early":  # half the vocabulary is EOS: the first canvas ends every row
        assert out.tokens.shape[1] == 5 + 8 and out.n_steps == 3
        assert bool((out.tokens[:, 5:] == 1).any())  # transformers' padding after EOS
    else:
        assert out.n_steps == budget
    assert out.trajectory.x_steps.shape == (out.n_steps, 2, out.tokens.shape[1])


def test_token_exact_with_left_padding(pair):
    ref, bridge = pair
    ids = _prompt(length=6)
    am = torch.ones_like(ids)
    am[1, :2] = 0
    kw = dict(max_new_tokens=8, max_denoising_steps=3)
    expected = _reference(ref, ids, 5, attention_mask=am, **kw)
    out = bridge.generate(ids, attention_mask=am, seed=5, **kw)
    assert torch.equal(out.tokens, expected.sequences)


def test_seed_changes_the_run(pair):
    _, bridge = pair
    ids = _prompt()
    a = bridge.generate(ids, seed=1, max_new_tokens=8, max_denoising_steps=2)
    b = bridge.generate(ids, seed=2, max_new_tokens=8, max_denoising_steps=2)
    c = bridge.generate(ids, seed=1, max_new_tokens=8, max_denoising_steps=2)
    assert not torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, c.tokens)


def test_states_reducers_and_cache(pair):
    _, bridge = pair
    ids = _prompt()
    seen = []

    def spy(x, hook):
        s = bridge.state
        seen.append((s.step, s.block, s.phase, int(s.masked[0].sum()), tuple(x.shape)))

    out = bridge.generate(
        ids, seed=3, max_new_tokens=16, max_denoising_steps=3, entropy_bound=1.5, t_min=0.05, t_max=0.1,
        record=[ReceivedAttention(query="masked", name="ra_masked"), ReceivedAttention(query="committed", name="ra_acc")],
        cache="blocks.1.attn.hook_pattern" @ steps(0, 4),
        fwd_hooks=[at_steps(spy, [0, 3], name="blocks.0.hook_resid_pre"),
                   ("encoder.0.hook_resid_pre", at_steps(spy, steps(phases=("encoder",))))])
    # encoder passes (prompt 5, then the first canvas 8) and the decoder passes at steps 0 and 3
    assert [s[:3] for s in seen] == [(0, 0, "encoder"), (0, 0, "cond"), (3, 1, "encoder"), (3, 1, "cond")]
    assert seen[0][4] == (2, 5, 32) and seen[2][4] == (2, 8, 32)
    assert seen[1][3] == 8 and seen[3][3] == 8  # nothing is committed before a canvas's last step
    ra = out.records["ra_masked"]
    assert ra.shape == (6, 2, 3, 4, 21)
    # keys of canvas 0 end at 13 (later keys do not exist yet: NaN); canvas 1 sees the whole sequence
    assert ra[:3, ..., 13:].isnan().all() and not ra[:3, ..., :13].isnan().any() and not ra[3:].isnan().any()
    assert out.record_meta["ra_masked"]["absent_keys"] == "nan"
    assert torch.allclose(ra[:3].nansum(-1), torch.ones(3, 2, 3, 4), atol=1e-5)
    acc = out.records["ra_acc"]  # mass over the rows committed at the step; zero where a step committed none
    n_acc = out.trajectory.n_committed
    assert torch.allclose(acc.nansum(-1), (n_acc > 0).float()[:, :, None, None].expand(-1, -1, 3, 4), atol=1e-5)
    pats = out.cache.stack("blocks.1.attn.hook_pattern", pad_value=0.0)
    assert out.cache.steps == [0, 4] and pats.shape == (2, 2, 4, 8, 21)
    # the step's pattern averaged over its not-yet-committed rows (the whole canvas) is the reducer's row
    x0 = out.trajectory.x_steps[0]
    assert (x0[:, 13:] == -1).all() and torch.equal(x0[:, :5], ids)
    assert torch.allclose(pats[0, :, :, :, :13].mean(2), ra[0, :, 1, :, :13], atol=1e-5)


def test_trajectory_commit_steps(pair):
    _, bridge = pair
    out = bridge.generate(_prompt(), seed=4, max_new_tokens=8, max_denoising_steps=4, entropy_bound=1.0,
                          t_min=0.05, t_max=0.1)
    cs = out.trajectory.commit_step
    # no stopping fires here: every position's argmax is final at the canvas's last step, and only there
    assert (cs[:, :5] == -1).all() and (cs[:, 5:] == 3).all()
    assert out.trajectory.n_committed.tolist() == [[0, 0], [0, 0], [0, 0], [8, 8]]
    acc = out.trajectory.accepted  # the samples kept in the next input, re-decided every step
    assert acc.shape == (4, 2, 13) and not acc[..., :5].any() and (acc.sum(-1) >= 1).all()


def test_settings_are_checked_before_compute(pair):
    _, bridge = pair
    ids = _prompt()
    with pytest.raises(SamplerConfigError, match="t_max"):
        bridge.generate(ids, t_min=0.9, t_max=0.5)
    with pytest.raises(SamplerConfigError, match="unknown setting alg='entropy' for sampler 'diffusion_gemma'"):
        bridge.generate(ids, alg="entropy")
    # the probes' LLaDA-style names, in DiffusionGemma's terms
    a = bridge.generate(ids, gen_length=8, steps=3, block_length=8, seed=1)
    b = bridge.generate(ids, max_new_tokens=8, max_denoising_steps=3, seed=1)
    assert torch.equal(a.tokens, b.tokens) and a.settings["max_denoising_steps"] == 3
    with pytest.raises(SamplerConfigError, match="not both"):
        bridge.generate(ids, steps=3, max_denoising_steps=3)
    with pytest.raises(SamplerConfigError, match="block_length=4"):
        bridge.generate(ids, gen_length=8, block_length=4)
    # steps is the total, as in LLaDA: 6 steps over two canvases = 3 per canvas
    a = bridge.generate(ids, gen_length=16, steps=6, seed=1)
    assert torch.equal(a.tokens, bridge.generate(ids, max_new_tokens=16, max_denoising_steps=3, seed=1).tokens)
    with pytest.raises(SamplerConfigError, match="does not split over the 2 canvases"):
        bridge.generate(ids, gen_length=16, steps=5)
    with pytest.raises(SamplerConfigError, match="needs gen_length"):
        bridge.generate(ids, steps=4)
    with pytest.raises(SamplerConfigError, match="entropy_bound"):
        bridge.generate(ids, entropy_bound=-1.0)
    with pytest.raises(SamplerConfigError, match="counted from the end"):
        bridge.generate(ids, max_new_tokens=8, record=[ReceivedAttention(when=steps(-1))])
    with pytest.raises(SamplerConfigError, match="static"):
        bridge.generate(ids, cache_implementation="static")
    # with stopping off, "last" is well defined
    out = bridge.generate(ids, max_new_tokens=8, max_denoising_steps=3, stability_threshold=None,
                          confidence_threshold=None, cache=TrajectoryCache("blocks.0.hook_resid_post", steps("last")))
    assert out.cache.steps == [2]


def test_common_generate_entry_point(pair):
    """`mdm_lens.diffusion.generate.generate` routes a DiffusionGemma model to this sampler ("auto" too)."""
    from mdm_lens.diffusion.generate import default_sampler, generate

    ref, bridge = pair
    ids = _prompt()
    assert default_sampler(bridge) == "diffusion_gemma"
    expected = _reference(ref, ids, 9, max_new_tokens=8, max_denoising_steps=2)
    out = generate(bridge, ids, seed=9, max_new_tokens=8, max_denoising_steps=2)
    assert torch.equal(out.tokens, expected.sequences) and out.sampler == "diffusion_gemma"
    with pytest.raises(SamplerConfigError, match="gen_length → max_new_tokens"):
        generate(bridge, ids, gen_length=8)
    with pytest.raises(SamplerConfigError, match="unknown setting"):
        generate(bridge, ids, sampler="llada", max_new_tokens=8)
