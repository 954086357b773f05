"""Replay on the window samplers (BD3LM, Nemotron; mdm_lens.diffusion.window_replay): for every step k of a run,
`out.replay(model, k)` returns exactly (torch.equal: the same operations on the same shapes) the logits the sampler's
own forward returned at step k, with the step's absolute rows; a step that ran no forward is refused, naming the
step whose forward it used. The run's logits are captured at `StepRunner.forward`, the call every sampler forward
and every replay goes through."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdm_lens import HookedMDM
from mdm_lens.diffusion.replay import step_inputs
from mdm_lens.errors import SamplerConfigError
from mdm_lens.hooks.runner import StepRunner

sys.path.insert(0, str(Path(__file__).parent / "families"))
from bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm  # noqa: E402
from nemotron_fixture import write_nemotron  # noqa: E402

BS, N = BD3LM_CONFIG["block_size"], BD3LM_CONFIG["model_length"]  # 4, 16


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    folder = write_bd3lm(tmp_path_factory.mktemp("bd3"), seed=1)[0]
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.fixture(scope="module")
def bd3_timed(tmp_path_factory):
    """time_conditioning on (the released checkpoints have it off): σ then changes the logits, so a replay at
    another step's σ would differ."""
    folder = write_bd3lm(tmp_path_factory.mktemp("bd3t"), dict(BD3LM_CONFIG, time_conditioning=True), seed=2)[0]
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    return HookedMDM.from_pretrained(str(write_nemotron(tmp_path_factory.mktemp("nemo"))[0]), load_tokenizer=False)


def _run(model, prompt, **kw):
    """The run and, per step, the logits its forward returned (None: the step ran no forward)."""
    seen: dict[int, torch.Tensor] = {}
    forward = StepRunner.forward

    def spy(self, state, tokens, **kwargs):
        logits = forward(self, state, tokens, **kwargs)
        assert state.step not in seen, "one forward per step"
        seen[state.step] = logits.clone()
        return logits

    StepRunner.forward = spy
    try:
        out = model.generate(torch.tensor(prompt), seed=0, **kw)
    finally:
        StepRunner.forward = forward
    return out, [seen.get(k) for k in range(out.n_steps)]


def _check_every_step(model, out, ran):
    replayed = 0
    for k, logits in enumerate(ran):
        if logits is None:
            with pytest.raises(SamplerConfigError) as e:
                out.replay(model, k)
            source = out.state_at(k).extra["reused_from"]
            assert e.value.argument == "step" and f"step {source}" in str(e.value) and ran[source] is not None
            continue
        got = out.replay(model, k)
        assert got.shape == logits.shape and torch.equal(got, logits), (k, (got - logits).abs().max())
        state = out.state_at(k)
        assert got.shape[1] == state.rows.stop - state.rows.start
        replayed += 1
    return replayed


def _bd3_rows(state, total, ctx):
    """The rows and keys BD3LM's step forwarded, from its block alone (the sampler's rule, restated)."""
    b = state.block
    end = min((b + 1) * BS, total)
    if not state.extra["kv_cache"]:
        start = max((b + 1) * BS - ctx, 0)
        return (start, end), (start, end)
    return (end - BS, end), None


BD3_LAYOUTS = {
    "one_window": ([[7]], dict(gen_length=15, steps=3)),
    "ragged_last_block": ([[7, 8]], dict(gen_length=13, steps=4, first_hitting=False)),
    "sliding_past_model_length": ([[7, 8]], dict(gen_length=26, steps=3)),
    "short_context": ([[7, 8, 9]], dict(gen_length=21, steps=5, first_hitting=False, context_size=8)),
    "kv_cache": ([[7]], dict(gen_length=15, steps=3, kv_cache=True)),
    "kv_cache_sliding": ([[7, 8]], dict(gen_length=30, steps=4, kv_cache=True, first_hitting=False)),
    "kv_cache_prompt_block": ([[7, 8, 9, 10, 11]], dict(gen_length=11, steps=3, kv_cache=True, nucleus_p=0.8)),
}


@pytest.mark.parametrize("layout", sorted(BD3_LAYOUTS))
def test_bd3lm_replay_equals_the_runs_forward_at_every_step(bd3, layout):
    prompt, kw = BD3_LAYOUTS[layout]
    out, ran = _run(bd3, prompt, **kw)
    assert _check_every_step(bd3, out, ran) == sum(r is not None for r in ran) > 0
    total, ctx = out.tokens.shape[1], kw.get("context_size", N)
    for k in range(out.n_steps):
        state = out.state_at(k)
        rows, keys = _bd3_rows(state, total, ctx)
        assert (state.rows.start, state.rows.stop) == rows
        if keys is not None:
            assert (state.keys.start, state.keys.stop) == keys
        else:  # the cache holds at most model_length positions ending at the block's end
            assert state.keys.stop == rows[1] and state.keys.stop - state.keys.start <= N
    if layout.endswith("sliding"):
        assert any(out.state_at(k).keys.start > 0 for k in range(out.n_steps))  # the cache did slide


def test_bd3lm_replay_uses_each_steps_own_sigma(bd3_timed):
    out, ran = _run(bd3_timed, [[7]], gen_length=15, steps=4, kv_cache=True)
    assert _check_every_step(bd3_timed, out, ran) > 0
    sigmas = {float(out.state_at(k).extra["sigma"][0]) for k in range(out.n_steps)}
    assert len(sigmas) > 2  # first hitting: a new t per step, so σ (which changes the logits here) differs


def test_bd3lm_step_without_forward_is_refused_but_has_a_state(bd3):
    out, ran = _run(bd3, [[7, 8]], gen_length=14, steps=6, first_hitting=False)
    idle = [k for k, r in enumerate(ran) if r is None]
    assert idle, "with first_hitting=False some step keeps every mask and reuses p(x0)"
    k = idle[0]
    state, source = out.state_at(k), out.state_at(k).extra["reused_from"]
    assert source < k and ran[source] is not None
    assert torch.equal(state.x, out.state_at(source).x)  # nothing changed since the forward it reused
    assert float(state.extra["t"][0]) < float(out.state_at(source).extra["t"][0])  # its own time
    with pytest.raises(SamplerConfigError, match=f"Replay step {source}"):
        out.replay(bd3, k)


def test_bd3lm_at_step_and_step_inputs_give_the_runs_forward(bd3):
    out, ran = _run(bd3, [[7]], gen_length=15, steps=3, kv_cache=True)
    k = out.n_steps - 2
    state, tokens, kwargs = step_inputs(out, bd3, k)
    assert torch.equal(bd3(tokens, return_type="aligned", **kwargs), ran[k])
    with out.at_step(bd3, k) as (tokens, kwargs):
        logits, cache = bd3.run_with_cache(tokens, return_type="aligned", **kwargs)
    # caching hook_pattern takes the explicit-softmax attention path instead of SDPA: equal up to fp32 rounding
    torch.testing.assert_close(logits, ran[k], rtol=0, atol=1e-5 * float(ran[k].abs().max()))
    keys = state.key_positions.shape[-1]  # the stored blocks (an unfinished one is not) and its own
    assert cache["blocks.0.attn.hook_pattern"].shape[-2:] == (BS, keys) and keys > BS and bd3.state is None


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p_len=st.integers(1, 6), blocks=st.integers(1, 7), ragged=st.integers(0, 3), steps=st.integers(1, 5),
       kv=st.booleans(), first_hitting=st.booleans(), ctx_blocks=st.integers(1, 4), seed=st.integers(0, 3))
def test_bd3lm_replay_random_settings(bd3, p_len, blocks, ragged, steps, kv, first_hitting, ctx_blocks, seed):
    prompt = [[(5 + 3 * i) % 50 for i in range(p_len)]]
    gen = max(blocks * BS - p_len, 1) + (0 if kv else ragged)
    if kv:
        gen += -(p_len + gen) % BS  # the cached form takes whole blocks
    kw = dict(gen_length=gen, steps=steps, kv_cache=kv, first_hitting=first_hitting, context_size=None if kv else ctx_blocks * BS)  # kv_cache: no window (inert, refused)
    out, ran = _run(bd3, prompt, **kw)
    assert _check_every_step(bd3, out, ran) >= 1


NEMO_RUNS = {
    "default": ([[5, 6, 7, 8]], dict(sampler="nemotron", gen_length=8)),
    "threshold_sampled": ([[5, 6, 7]], dict(sampler="nemotron", gen_length=12, block_length=3, threshold=0.3,
                                           temperature=0.7)),
    "batch_of_two": ([[5, 6, 7], [9, 10, 11]], dict(sampler="nemotron", gen_length=10, block_length=5)),
    "ar": ([[5, 6, 7, 8]], dict(sampler="nemotron_ar", gen_length=4)),
}


@pytest.mark.parametrize("case", sorted(NEMO_RUNS))
def test_nemotron_replay_equals_the_runs_forward_at_every_step(nemo, case):
    prompt, kw = NEMO_RUNS[case]
    out, ran = _run(nemo, prompt, **kw)
    assert all(r is not None for r in ran)
    assert _check_every_step(nemo, out, ran) == out.n_steps
    p, bl = len(prompt[0]), kw.get("block_length", 4)
    kinds = [out.state_at(k).extra["kind"] for k in range(out.n_steps)]
    if case == "ar":
        assert set(kinds) == {"ar"}
        assert [out.state_at(k).rows.stop for k in range(out.n_steps)] == list(range(p, p + out.n_steps))
        return
    assert kinds[0] == "prefill" and out.state_at(0).rows == slice(0, p)
    for k, kind in enumerate(kinds):
        state = out.state_at(k)
        if kind == "denoise":  # the block's rows at their absolute positions, keys from 0
            lo = p + state.block * bl
            assert state.rows == slice(lo, lo + bl) and state.keys == slice(0, lo + bl)
        elif kind == "commit":
            assert state.rows == slice(0, p + (state.block + 1) * bl)
    assert all(b.attn.kv is None for b in nemo.blocks)  # the rebuilt cache is detached after each replay


def test_nemotron_hooks_fire_on_the_replayed_step_only(nemo):
    out, ran = _run(nemo, [[5, 6, 7, 8]], sampler="nemotron", gen_length=8)
    k = next(k for k in range(out.n_steps) if out.state_at(k).extra["kind"] == "denoise" and out.state_at(k).block)
    fired = []
    out.replay(nemo, k, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: fired.append(tuple(x.shape)))])
    assert fired == [(1, 4, nemo.cfg.d_model)]  # the block's rows; the prefix re-run that fills the cache is unhooked
    with pytest.raises(SamplerConfigError, match="at_step"):
        step_inputs(out, nemo, k)
    with out.at_step(nemo, k) as (tokens, kwargs):
        logits = nemo(tokens, return_type="aligned", **kwargs)
    assert torch.equal(logits, ran[k])
    assert all(b.attn.kv is None for b in nemo.blocks)
    grad = out.replay(nemo, k, grad=True)
    assert grad.requires_grad and torch.equal(grad.detach(), ran[k])


def test_a_step_that_reused_step_0_is_refused_too(bd3):
    """`reused_from` = 0 is a step index like any other (a truthiness test would let it replay a forward it never
    ran): the first block's step 1 reuses step 0's p(x0) when step 0 committed nothing."""
    for seed in range(40):
        prompt = torch.tensor([[7, 8, 9, 10]])  # the first generated block starts at step 0
        out = bd3.generate(prompt, gen_length=4, steps=8, first_hitting=False, seed=seed)
        zero = [k for k in range(1, out.n_steps) if out.state_at(k).extra.get("reused_from") == 0]
        if zero:
            with pytest.raises(SamplerConfigError, match="step 0"):
                out.replay(bd3, zero[0])
            return
    pytest.fail("no seed in 0..39 gave a step reusing step 0's p(x0); the planted case needs another setting")


@pytest.mark.parametrize("prompt_length,gen_length,steps,want", [
    (3, 6, 2, 6),    # positions 0..8 over blocks of 4: blocks 0, 1, 2 hold generated positions (the last ragged)
    (4, 6, 2, 4),    # block 0 is all prompt: blocks 1, 2
    (4, 8, 3, 6),    # whole blocks 1, 2
    (5, 1, 5, 5),    # one generated position inside block 1
])
def test_bd3lm_knockout_grid_counts_every_block_holding_a_generated_position(prompt_length, gen_length, steps, want):
    from mdm_lens.diffusion.own_forwards import max_denoising_forwards

    settings = dict(gen_length=gen_length, steps=steps, block_size=BS)
    assert BS == 4 and max_denoising_forwards("bd3lm", settings, prompt_length) == want
    assert max_denoising_forwards("nemotron", dict(gen_length=gen_length), prompt_length) == gen_length
