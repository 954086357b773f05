"""`KeyValueNorms` and `TopKKeys` on KV-cached runs (`kv_cache="prefix"|"dual"`): they read the keys/values the
cached forward really attends to (cached rows outside the window, fresh rows in it) and the window's query rows.

Checked against the cache emulated by hook substitution (tests/test_kv_cache.py proves it equal to the cache): the
block-start forward's keys/values put back outside the window."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import KeyValueNorms, SamplerConfigError, TopKKeys
from mdm_lens.hooks.reducers import ABSENT_KEY, ReceivedAttention
from mdm_lens.kvcache import LayerKV
from test_kv_cache import NO_MASK, PROMPT, _kv_names, fill_kv, model  # noqa: F401  (fixture)

P0, BLOCK, GEN = PROMPT.shape[1], 4, 8
TOTAL = P0 + GEN


def test_attended_rows_on_a_planted_cache():
    """Planted cache rows: prefix joins [cache; rows], dual writes the rows into a copy of the cache's window, fill
    (the refresh) is the rows themselves; the cache itself never changes."""
    layer = LayerKV()
    cache_k = torch.arange(24.0).view(1, 6, 2, 2)
    rows = -torch.arange(8.0).view(1, 2, 2, 2) - 1
    layer.k, layer.v = cache_k.clone(), 2 * cache_k.clone()
    layer.mode, layer.window = "prefix", None
    assert torch.equal(layer.attended(rows, "k"), torch.cat([cache_k, rows], dim=1))
    layer.mode, layer.window = "dual", (3, 5)
    got = layer.attended(rows, "v")
    assert torch.equal(got[:, :3], 2 * cache_k[:, :3]) and torch.equal(got[:, 3:5], rows)
    assert torch.equal(got[:, 5:], 2 * cache_k[:, 5:])
    assert torch.equal(layer.k, cache_k) and torch.equal(layer.v, 2 * cache_k)  # untouched
    layer.mode = "fill"
    assert layer.attended(rows, "k") is rows
    empty = LayerKV()
    empty.mode, empty.window = "dual", (0, 2)
    with pytest.raises(RuntimeError, match="before the cache was filled"):
        empty.attended(rows, "k")


def _window(out, step, mode):
    """(refresh step of the step's block, window start, window end) as the cached loop runs it."""
    blocks = out.trajectory.block_of_step.tolist()
    b = blocks[step]
    refresh = blocks.index(b)
    if step == refresh:
        return refresh, 0, TOTAL
    lo = P0 + b * BLOCK
    return refresh, lo, TOTAL if mode == "prefix" else lo + BLOCK


def by_hand(model, x, stale, keep):
    """Keys, values and patterns of the uncached forward with the stale rows put back outside `keep`."""
    got = {}

    def put(t, hook):
        return torch.where(keep[None, :, None, None], t, stale[hook.name])

    def grab(t, hook):
        got[hook.name] = t.detach().clone()

    names = _kv_names(model) + [f"blocks.{l}.attn.hook_pattern" for l in range(model.cfg.n_layers)]
    model.run_with_hooks(x, return_type=None, fwd_hooks=[(n, put) for n in _kv_names(model)]
                         + [(n, grab) for n in names])
    return got


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_records_equal_the_cache_rows_by_hand(model, mode):
    out = model.generate(PROMPT, gen_length=GEN, steps=GEN, block_length=BLOCK, kv_cache=mode, fwd_hooks=NO_MASK,
                         record=[KeyValueNorms(), TopKKeys(k=3)])
    check(model, out, mode)


def check(model, out, mode):
    r = out.records
    n_steps = out.trajectory.n_steps
    k_top = r["topk_keys"].shape[-1]
    assert r["key_norms"].shape == (n_steps, 1, 2, 2, TOTAL) and r["topk_keys"].shape == (n_steps, 1, 2, 4, TOTAL,
                                                                                           k_top)
    with torch.no_grad():
        for step in range(n_steps):
            refresh, lo, hi = _window(out, step, mode)
            keep = torch.zeros(TOTAL, dtype=torch.bool)
            keep[lo:hi] = True
            stale = fill_kv(model, out.trajectory.x_steps[refresh])
            got = by_hand(model, out.trajectory.x_steps[step], stale, keep)
            want_age = torch.where(keep, torch.tensor(step), torch.tensor(refresh))
            assert torch.equal(r["kv_age"][step], want_age)
            for l in range(2):
                k, v = got[f"blocks.{l}.attn.hook_rot_k"][0], got[f"blocks.{l}.attn.hook_v"][0]
                torch.testing.assert_close(r["key_norms"][step, 0, l], k.norm(dim=-1).T, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(r["value_norms"][step, 0, l], v.norm(dim=-1).T, atol=1e-5, rtol=1e-5)
                pattern = got[f"blocks.{l}.attn.hook_pattern"][0, :, lo:hi]  # [head, window, key]
                vals, idx = r["topk_attention"][step, 0, l], r["topk_keys"][step, 0, l]
                torch.testing.assert_close(vals[:, lo:hi], pattern.topk(k_top, dim=-1).values, atol=1e-5, rtol=0)
                # the keys are absolute positions: the pattern there holds the recorded weights
                torch.testing.assert_close(pattern.gather(-1, idx[:, lo:hi]), vals[:, lo:hi], atol=1e-5, rtol=0)
                outside = torch.ones(TOTAL, dtype=torch.bool)
                outside[lo:hi] = False
                assert vals[:, outside].isnan().all() and (idx[:, outside] == ABSENT_KEY).all()
            if step != refresh:  # the cached rows are the refresh step's, bit for bit
                cached = ~keep
                assert torch.equal(r["key_norms"][step][..., cached], r["key_norms"][refresh][..., cached])


def test_one_block_one_token_per_step_equals_the_uncached_run_at_the_block_start(model):
    """One block, one token per step: the block's first step is a full forward on the same canvas as the uncached
    run's first step, so every record equals the uncached run's there; after it the prompt's (cached) rows keep
    those values while the uncached run recomputes them."""
    kw = dict(gen_length=BLOCK, steps=BLOCK, block_length=BLOCK, temperature=0.0, fwd_hooks=NO_MASK)
    cached = model.generate(PROMPT, kv_cache="dual", record=[KeyValueNorms(), TopKKeys(k=2)], **kw)
    plain = model.generate(PROMPT, record=[KeyValueNorms(), TopKKeys(k=2)], **kw)
    assert cached.trajectory.n_committed[:, 0].tolist() == [1] * BLOCK
    assert torch.equal(cached.trajectory.x_steps[0], plain.trajectory.x_steps[0])
    for name in ("key_norms", "value_norms", "topk_attention"):
        torch.testing.assert_close(cached.records[name][0], plain.records[name][0], atol=1e-6, rtol=0)
    assert torch.equal(cached.records["topk_keys"][0], plain.records["topk_keys"][0])
    assert "kv_age" not in plain.records
    later = cached.records["key_norms"][1:, ..., :P0]
    assert torch.equal(later, cached.records["key_norms"][:1, ..., :P0].expand_as(later))
    assert not torch.allclose(plain.records["key_norms"][1:, ..., :P0], later, atol=1e-6)  # staleness is real here


@pytest.fixture(scope="module")
def dream():
    from mdm_lens import HookedMDM, MDMConfig
    from sampler_rigs import identity_unembed

    cfg = MDMConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=16, d_vocab=20, mask_token_id=19,
                    n_ctx=40, logit_shift=True)
    return identity_unembed(HookedMDM.from_config(cfg, seed=5, init_std=0.6))


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_a_dream_cached_run_records_the_cached_rows_too(dream, mode):
    out = dream.generate(PROMPT, gen_length=GEN, steps=GEN, block_length=BLOCK, kv_cache=mode, fwd_hooks=NO_MASK,
                         record=[KeyValueNorms(), TopKKeys(k=2), ReceivedAttention()])
    check(dream, out, mode)


def test_other_reducers_are_still_refused_on_a_cached_run(model):
    class Custom(KeyValueNorms.__mro__[1]):  # a plain Reducer: it places rows at positions 0..
        name = "custom"

    with pytest.raises(SamplerConfigError) as info:
        model.generate(PROMPT, gen_length=GEN, block_length=BLOCK, kv_cache="prefix", record=[Custom()])
    assert info.value.argument == "record"


@pytest.mark.parametrize("which", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_state_at_rebuilds_each_cached_steps_state_and_replay_stays_refused(model, dream, which, mode):
    # misuse13 U4: state_at refused every kv_cache step though is_last is documented to answer there after the run
    m = model if which == "llada" else dream
    seen = []

    def spy(x, hook):
        st = m.state
        seen.append((st.step, st.rows, st.block, st.block_slice, st.masked.clone(), st.x.clone(), st.extra["refresh"]))

    out = m.generate(PROMPT, gen_length=GEN, steps=GEN, block_length=BLOCK, kv_cache=mode,
                     fwd_hooks=list(NO_MASK) + [("blocks.0.hook_resid_pre", spy)])
    assert len(seen) == out.n_steps
    for s, rows, block, span, masked, x, refresh in seen:
        st = out.state_at(s)
        assert (st.rows, st.block, st.block_slice, st.extra["refresh"]) == (rows, block, span, refresh)
        assert torch.equal(st.masked, masked) and torch.equal(st.x, x)
    assert [out.state_at(k).is_last for k in range(out.n_steps)] == [False] * (out.n_steps - 1) + [True]
    with pytest.raises(SamplerConfigError, match="replay is not available for kv_cache"):
        out.replay(m, 0)
