"""BD3LM (mdm_lens.ddit.bd3lm / diffusion.bd3lm): hub-layout loading with config facts, the three forward forms exact
against a plain-torch transcription of the reference backbone, the conditioning hooks, the semi-AR sampler
token-exact against a transcription of `_semi_ar_sampler` on every option, and KV-cached == recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.ddit.bd3lm import HookedBD3LM, block_causal_mask, block_diff_mask
from mdm_lens.errors import ConfigError, InputError, SamplerConfigError
from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm
from tests.families.bd3gidd_reference import BD3Reference, reference_semi_ar

MASK, N, BS = 56, 16, 4


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    folder, sd = write_bd3lm(tmp_path_factory.mktemp("bd3"), seed=1)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


@pytest.fixture(scope="module")
def bd3_tc(tmp_path_factory):  # time-conditioned: σ reaches the network
    folder, sd = write_bd3lm(tmp_path_factory.mktemp("bd3tc"), dict(BD3LM_CONFIG, time_conditioning=True), seed=2)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


def _xt_x0(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, MASK, (batch, N), generator=g)
    xt = x0.clone()
    xt[torch.rand(x0.shape, generator=g) < 0.5] = MASK
    return xt, x0


def _close(got, ref):
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


def test_config_values_and_buffers_are_read(bd3):
    model, _ = bd3
    assert isinstance(model, HookedBD3LM)
    c = model.cfg
    assert (c.family, c.d_vocab, c.n_ctx, c.d_model, c.n_layers, c.n_heads, c.mask_token_id) == \
        ("bd3lm", 57, 16, 32, 2, 4, 56)
    assert c.extra["block_size"] == 4 and c.extra["cond_dim"] == 24 and c.extra["attn_backend"] == "sdpa"
    assert c.extra["sampling_eps_min"] == pytest.approx(0.05) and c.extra["sampling_eps_max"] == pytest.approx(0.8)
    assert c.extra["time_conditioning"] is False and c.extra["parameterization"] == "subs"


def test_absent_keys_take_the_bd3lm_config_class_defaults(tmp_path):
    cfg = dict(BD3LM_CONFIG, cond_dim=129)
    folder, _ = write_bd3lm(tmp_path, cfg, drop=("cond_dim", "block_size", "attn_backend", "sampling_eps_min"))
    c = HookedMDM.from_pretrained(str(folder), load_tokenizer=False).cfg
    assert c.extra["cond_dim"] == 129 and c.extra["block_size"] == 1 and c.extra["attn_backend"] == "flex"
    # the checkpoint's buffer (0.05) wins over the class default (1e-3) the config would give
    assert c.extra["sampling_eps_min"] == pytest.approx(0.05)


@pytest.mark.parametrize("change", [dict(cross_attn=False), dict(adaln=False), dict(causal=True),
                                    dict(block_size=5), dict(attn_backend="eager")])
def test_unsupported_layouts_are_refused(tmp_path, change):
    folder, _ = write_bd3lm(tmp_path, dict(BD3LM_CONFIG, **change))
    with pytest.raises(ConfigError):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_masks_match_the_reference_definition():
    m = block_diff_mask(4, 2)
    # x_t row 2 (block 1) sees x_t block 1 and clean block 0 only
    assert m[2].tolist() == [False, False, True, True, True, True, False, False]
    # clean row 6 (block 1) sees clean blocks 0 and 1 only
    assert m[6].tolist() == [False, False, False, False, True, True, True, True]
    assert torch.equal(block_causal_mask(4, 2), m[4:, 4:])


def test_training_form_is_exact(bd3, bd3_tc):
    for (model, sd), tc in ((bd3, False), (bd3_tc, True)):
        xt, x0 = _xt_x0()
        sigma = torch.tensor([0.3, 2.5])
        ref = BD3Reference(sd, 4, N, BS, time_conditioning=tc)(torch.cat([xt, x0], 1), sigma)
        _close(model(xt, sigma=sigma, x0=x0), ref)


def test_sampling_window_is_exact_and_block_causal(bd3):
    model, sd = bd3
    xt, _ = _xt_x0()
    ref = BD3Reference(sd, 4, N, BS)(xt[:, :10], torch.zeros(2), sample_mode=True)
    _close(model(xt[:, :10]), ref)
    _, cache = model.run_with_cache(xt[:, :10], names_filter="blocks.1.attn.hook_pattern")
    pat = cache["blocks.1.attn.hook_pattern"]
    assert pat.shape == (2, 4, 10, 10)
    assert float(pat[..., ~block_causal_mask(10, BS)].abs().max()) == 0.0
    # a later block does not change an earlier block's logits
    other = xt[:, :10].clone()
    other[:, 8:] = 3
    torch.testing.assert_close(model(other)[:, :8], model(xt[:, :10])[:, :8], atol=1e-5, rtol=0)


def test_cached_form_is_exact_block_by_block_and_equals_recomputing(bd3_tc):
    model, sd = bd3_tc
    xt, x0 = _xt_x0(seed=3)
    ref = BD3Reference(sd, 4, N, BS, time_conditioning=True)
    ref.reset_kv_cache(2)
    cache, sigma = model.new_kv_cache(2), torch.tensor([0.7, 0.7])
    for b in range(N // BS):
        rows = slice(b * BS, (b + 1) * BS)
        _close(model(xt[:, rows], sigma=sigma, kv_cache=cache), ref(xt[:, rows], sigma, sample_mode=True))
        model(x0[:, rows], sigma=sigma, kv_cache=cache, store_kv=True)
        ref(x0[:, rows], sigma, sample_mode=True, store_kv=True)
    assert cache.idx == N - BS  # the window slid once the cache was full
    _close(model(xt[:, :BS], sigma=sigma, kv_cache=cache), ref(xt[:, :BS], sigma, sample_mode=True))  # after the slide
    # before the cache is full: cached keys == recomputing the window under the block-causal mask
    cache = model.new_kv_cache(2)
    for b in range(3):
        model(x0[:, b * BS:(b + 1) * BS], sigma=sigma, kv_cache=cache, store_kv=True)
    window = torch.cat([x0[:, :12], xt[:, 12:]], 1)
    torch.testing.assert_close(model(xt[:, 12:], sigma=sigma, kv_cache=cache), model(window, sigma=sigma)[:, 12:],
                               atol=1e-4, rtol=0)


def test_cached_attention_hooks_see_cached_keys(bd3):
    model, _ = bd3
    cache = model.new_kv_cache(1)
    model(torch.arange(4)[None], kv_cache=cache, store_kv=True)
    _, act = model.run_with_cache(torch.full((1, 4), MASK), kv_cache=cache)
    assert act["blocks.0.attn.hook_pattern"].shape == (1, 4, 4, 8)
    assert act["blocks.0.attn.hook_k"].shape == (1, 8, 4, 8) and act["blocks.0.attn.hook_q"].shape == (1, 4, 4, 8)
    assert cache.idx == 4  # a forward without store_kv leaves the cache's index alone


def test_every_block_hook_fires(bd3):
    model, _ = bd3
    _, act = model.run_with_cache(_xt_x0()[0])
    for i in range(2):
        for name in ("adaLN.hook_gate_msa", "adaLN.hook_scale_mlp", "attn.hook_q", "attn.hook_rot_k", "attn.hook_z",
                     "mlp.hook_post", "hook_attn_out", "hook_mlp_out", "hook_resid_post", "ln1.hook_normalized"):
            assert f"blocks.{i}.{name}" in act.keys()


def test_conditioning_hook_equals_editing_sigma(bd3_tc):
    model, _ = bd3_tc
    xt, _ = _xt_x0()
    want = model(xt, sigma=torch.tensor([1.5, 0.2]))
    got = model.run_with_hooks(xt, sigma=torch.tensor([0.0, 0.0]),
                               fwd_hooks=[("hook_sigma", lambda s, hook: torch.tensor([1.5, 0.2]))])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (model(xt, sigma=0.0) - want).abs().max() > 1e-2  # σ matters in this model


def test_forward_arguments_are_checked(bd3):
    model, _ = bd3
    xt, x0 = _xt_x0()
    with pytest.raises(InputError, match="x0"):
        model(xt[:, :8], x0=x0[:, :8])
    with pytest.raises(InputError, match="block_size"):
        model(xt[:, :3], kv_cache=model.new_kv_cache(2))
    with pytest.raises(InputError, match="store_kv"):
        model(xt[:, :4], store_kv=True)
    with pytest.raises(InputError):
        model(xt[:, :4], x0=x0, kv_cache=model.new_kv_cache(2))


@pytest.mark.parametrize("first_hitting", [True, False])
@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("nucleus_p", [1.0, 0.6])
def test_sampler_is_token_exact(bd3, first_hitting, kv_cache, nucleus_p):
    model, sd = bd3
    batch = 1 if first_hitting else 2
    out = model.generate(torch.full((batch, 1), 7), gen_length=15, steps=6, first_hitting=first_hitting,
                         kv_cache=kv_cache, nucleus_p=nucleus_p, seed=5)
    torch.manual_seed(5)
    np.random.seed(5)
    ref = reference_semi_ar(BD3Reference(sd, 4, N, BS), batch, 6, 4, 7, MASK, first_hitting=first_hitting,
                            nucleus_p=nucleus_p, kv_cache=kv_cache)
    assert torch.equal(out.tokens, ref)
    assert not bool((out.tokens == MASK).any()) or not first_hitting


@pytest.mark.parametrize("first_hitting", [True, False])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_sampler_beyond_model_length_slides_like_the_reference(bd3, first_hitting, kv_cache):
    # 28 tokens with model_length 16: the forward window and the cache slide by one block, positions restart
    model, sd = bd3
    batch = 1 if first_hitting else 2
    out = model.generate(torch.full((batch, 1), 7), gen_length=27, steps=6, first_hitting=first_hitting,
                         kv_cache=kv_cache, seed=5)
    torch.manual_seed(5)
    np.random.seed(5)
    ref = reference_semi_ar(BD3Reference(sd, 4, N, BS), batch, 6, 7, 7, MASK, first_hitting=first_hitting,
                            kv_cache=kv_cache)
    assert out.tokens.shape == (batch, 28) and torch.equal(out.tokens, ref)


def test_nucleus_and_seed_change_the_sample(bd3):
    model, _ = bd3
    p = torch.full((1, 1), 7)
    a = model.generate(p, gen_length=15, steps=6, seed=5).tokens
    assert not torch.equal(a, model.generate(p, gen_length=15, steps=6, seed=5, nucleus_p=0.6).tokens)
    assert not torch.equal(a, model.generate(p, gen_length=15, steps=6, seed=6).tokens)


def test_kv_cached_sampling_equals_recomputing_and_states_name_rows_and_keys(bd3):
    # without time conditioning (the released models) the cached keys are the recomputed ones; a time-conditioned
    # model's cache holds keys computed at the σ of the step that stored them, so the two differ there
    model, _ = bd3
    seen = []

    def spy(x, hook):
        s = model.state
        seen.append((s.block, s.query_rows, s.key_cols, s.extra["kv_store"], float(s.extra["sigma"][0]),
                     float(s.extra["t"][0])))

    p = torch.tensor([[7, 3]])
    plain = model.generate(p, gen_length=14, steps=8, seed=2)
    cached = model.generate(p, gen_length=14, steps=8, seed=2, kv_cache=True, fwd_hooks=[("hook_embed", spy)])
    assert torch.equal(plain.tokens, cached.tokens)
    assert seen[0][:4] == (0, slice(0, 4), slice(0, 4), False)
    stores = [s for s in seen if s[3]]
    assert [s[0] for s in stores] == [0, 1, 2, 3]
    assert stores[2][1:3] == (slice(8, 12), slice(0, 12))
    steps = [s for s in seen if s[0] == 1 and not s[3]]
    for _, _, _, _, sigma, t in steps:  # first hitting: t < 1 falls within the block; σ = −log(1 − t)
        assert 0 < t < 1 and sigma == pytest.approx(min(-np.log1p(-t), -np.log(1e-3)), rel=1e-5)
    assert [s[5] for s in steps] == sorted((s[5] for s in steps), reverse=True)


def test_sampler_refusals(bd3):
    model, _ = bd3
    with pytest.raises(SamplerConfigError, match="first_hitting"):
        model.generate(torch.full((2, 1), 7), gen_length=15, steps=4)
    with pytest.raises(SamplerConfigError, match="multiple of block_size"):  # the cached form takes whole blocks
        model.generate(torch.full((1, 1), 7), gen_length=14, steps=4, kv_cache=True)
    with pytest.raises(InputError, match="mask token"):
        model.generate(torch.tensor([[7, MASK]]), gen_length=14, steps=4)
    with pytest.raises(SamplerConfigError, match="context_size"):
        model.generate(torch.full((1, 1), 7), gen_length=15, steps=4, context_size=6)


def test_a_ragged_last_block_leaves_the_whole_blocks_as_they_were(bd3):
    """prompt 1 + gen 14 = 15 (block_size 4): blocks 0..2 are decoded exactly as in the 16-long canvas (same draws,
    in the same order; the block-causal mask hides later blocks), the 3-long last block is decoded too, and the
    plan counts 4 blocks; the state's block slice ends with the canvas."""
    from mdm_lens.diffusion.registry import get

    model, _ = bd3
    whole = model.generate(torch.full((1, 1), 7), gen_length=15, steps=4, seed=5)
    seen = []
    ragged = model.generate(torch.full((1, 1), 7), gen_length=14, steps=4, seed=5,
                            fwd_hooks=[("hook_embed", lambda x, hook: seen.append(model.state.block_slice))])
    assert ragged.tokens.shape == (1, 15)
    assert torch.equal(ragged.tokens[:, :12], whole.tokens[:, :12])
    assert slice(12, 15) in seen and all(sl.stop <= 15 for sl in seen)
    s = get("bd3lm").settings(model, dict(gen_length=14, steps=4))
    assert get("bd3lm").plan(s, 1).n_blocks == 4 and get("bd3lm").plan(s, 1).n_steps == 16
    assert ragged.attention_mask.shape == ragged.tokens.shape


@pytest.mark.parametrize("kv_cache", [False, True])
def test_one_step_per_block_stores_each_block_once(bd3, kv_cache):
    # one step unmasks a whole block (mask_prob 0); the block's keys must be stored once, not again by the branch
    # for all-prompt blocks (a one-step loop also ends at i == 0), else every later block sees shifted keys
    model, sd = bd3
    calls = []
    out = model.generate(torch.full((2, 1), 7), gen_length=15, steps=1, first_hitting=False, kv_cache=kv_cache,
                         seed=3, fwd_hooks=[("hook_embed", lambda t, hook: calls.append(t.shape[1]))])
    torch.manual_seed(3)
    np.random.seed(3)
    ref = reference_semi_ar(BD3Reference(sd, 4, N, BS), 2, 1, 4, 7, MASK, first_hitting=False, kv_cache=kv_cache)
    assert torch.equal(out.tokens, ref)
    assert len(calls) == (8 if kv_cache else 4)  # 4 blocks: one denoising forward each (+ one storing forward)
