"""Samplers, DenoisingState, step-bound hooks, the trajectory cache and streaming reducers."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import (HookedMDM, HookNameError, KeyValueNorms, MDMConfig, MemoryBudgetError, ReceivedAttention,
                      SamplerConfigError, TopKKeys, TrajectoryCache, at_steps, steps)
from mdm_lens.diffusion.schedules import dream_schedule, llada_transfer_counts

MASK = 49


def model_for(kind="llada", seed=1, n_ctx=64):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream",
                    n_ctx=n_ctx, eos_token_id=1)
    # unit norms: the rigged-order tests plant logits through W_U with ln_final.w = 1, and the schedule tests
    # assume these weights never commit the mask id (on realistic weights Dream's sampler commits 49; see report)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3, init="normal")


PROMPT = torch.randint(2, 40, (2, 5), generator=torch.Generator().manual_seed(0))


# --- LLaDA sampler invariants ---------------------------------------------------------------------

@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("block_length", [12, 4])
def test_llada_invariants(remasking, block_length):
    model = model_for()
    steps_, gen = 12, 12
    out = model.generate(PROMPT, steps=steps_, gen_length=gen, block_length=block_length, remasking=remasking)
    traj = out.trajectory
    assert traj.n_steps == steps_
    assert torch.equal(out.tokens[:, :5], PROMPT)  # prompt untouched
    assert not (out.tokens == MASK).any()  # nothing left masked
    xs = torch.cat([traj.x_steps, out.tokens[None]], dim=0)
    for s in range(steps_):  # committed tokens never change afterwards
        done = xs[s] != MASK
        assert torch.equal(xs[s][done], xs[s + 1][done])
    # exactly the scheduled number per step, block by block
    n_blocks = gen // block_length
    spb = steps_ // n_blocks
    for b in range(n_blocks):
        sched = llada_transfer_counts(torch.ones(2, block_length, dtype=torch.bool), spb)
        assert torch.equal(traj.n_committed[b * spb:(b + 1) * spb].T, sched)
        # blocks fill in order: block b's positions are committed during block b's steps
        cs = traj.commit_step[:, 5 + b * block_length: 5 + (b + 1) * block_length]
        assert ((cs >= b * spb) & (cs < (b + 1) * spb)).all()
    assert (traj.commit_step[:, :5] == -1).all() and (traj.commit_step[:, 5:] >= 0).all()


def test_llada_schedule_counts():
    counts = llada_transfer_counts(torch.ones(1, 10, dtype=torch.bool), 4)
    assert counts.tolist() == [[3, 3, 2, 2]]


def test_temperature_zero_is_deterministic_and_seeds_reproduce():
    model = model_for()
    a = model.generate(PROMPT, steps=8, gen_length=8, seed=1)
    b = model.generate(PROMPT, steps=8, gen_length=8, seed=2)
    assert torch.equal(a.tokens, b.tokens)  # T=0: no randomness at all
    c = model.generate(PROMPT, steps=8, gen_length=8, temperature=1.0, seed=3)
    d = model.generate(PROMPT, steps=8, gen_length=8, temperature=1.0, seed=3)
    e = model.generate(PROMPT, steps=8, gen_length=8, temperature=1.0, seed=4)
    assert torch.equal(c.tokens, d.tokens) and not torch.equal(c.tokens, e.tokens)


def _rig(model):
    """Unembedding = identity onto the first d_model tokens, and a final-norm hook that writes, at
    position p, a one-hot on token (p mod 30) + 2 with strength 1 + p/2: the confidence grows with p."""
    with torch.no_grad():
        model.unembed.weight.zero_()
        model.unembed.weight[:32].copy_(torch.eye(32))

    def hook(x, hook):
        out = torch.zeros_like(x)
        pos = torch.arange(x.shape[1])
        out[:, pos, (pos % 30) + 2] = (1 + pos / 2).to(x.dtype)
        return out

    return [("ln_final.hook_normalized", hook)]


def test_rigged_model_commits_in_the_known_order():
    model = model_for()
    out = model.generate(PROMPT, steps=6, gen_length=6, fwd_hooks=_rig(model))
    # confidence rises with position → right to left, one token per step, each the rigged token
    assert out.trajectory.order(0) == [10, 9, 8, 7, 6, 5]
    assert out.tokens[0, 5:].tolist() == [(p % 30) + 2 for p in range(5, 11)]
    # with two blocks the left block is finished first, right to left inside each block
    out = model.generate(PROMPT, steps=6, gen_length=6, block_length=3, fwd_hooks=_rig(model))
    assert out.trajectory.order(0) == [7, 6, 5, 10, 9, 8]


def test_cfg_runs_the_unconditional_pass_with_the_prompt_masked():
    model = model_for()
    seen = []

    def spy(x, hook):
        seen.append((model.state.phase, int((model.state.x[:, :5] == MASK).sum())))

    out = model.generate(PROMPT, steps=4, gen_length=4, cfg_scale=1.5,
                         fwd_hooks=[at_steps(spy, steps(phases=("cond", "uncond")), name="hook_embed")])
    assert seen[:2] == [("cond", 0), ("uncond", 10)] and len(seen) == 8
    assert not (out.tokens == MASK).any()


def test_eos_suppression():
    model = model_for()
    with torch.no_grad():
        model.unembed.weight[1] += 5.0  # make EOS (id 1) the argmax almost everywhere
    plain = model.generate(PROMPT, steps=6, gen_length=6)
    suppressed = model.generate(PROMPT, steps=6, gen_length=6, logits_eos_inf=True)
    assert (plain.generated == 1).any() and not (suppressed.generated == 1).any()


# --- Dream -----------------------------------------------------------------------------------------

def test_dream_schedule_known_cases():
    assert dream_schedule(8, 8) == [0, 1, 1, 1, 1, 1, 1, 2]
    assert dream_schedule(16, 8) == [1, 2, 2, 2, 2, 2, 2, 3]
    assert dream_schedule(32, 32) == [0] + [1] * 30 + [2]


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_runs_the_schedule(alg):
    model = model_for("dream")
    out = model.generate(PROMPT, steps=8, gen_length=8, alg=alg)
    assert out.sampler == "dream"
    assert out.trajectory.n_committed[:, 0].tolist() == [0, 1, 1, 1, 1, 1, 1, 2]
    assert not (out.tokens == MASK).any() and torch.equal(out.tokens[:, :5], PROMPT)


def test_dream_origin_and_sampling_are_seeded():
    model = model_for("dream")
    a = model.generate(PROMPT, steps=8, gen_length=8, alg="origin", temperature=0.5, top_p=0.9, seed=5)
    b = model.generate(PROMPT, steps=8, gen_length=8, alg="origin", temperature=0.5, top_p=0.9, seed=5)
    assert torch.equal(a.tokens, b.tokens)
    assert not (a.tokens == MASK).any()  # origin transfers everything left at the last step
    c = model.generate(PROMPT, steps=8, gen_length=8, alg="entropy", alg_temp=0.5, top_k=5, seed=6)
    assert c.trajectory.n_committed.sum(0).tolist() == [8, 8]


def test_dream_logit_shift_reads_the_previous_position():
    """The prediction for canvas position p comes from hidden state p-1: the rig on position p-1 decides it."""
    model = model_for("dream")
    out = model.generate(PROMPT, steps=6, gen_length=6, alg="maskgit_plus", temperature=0, fwd_hooks=_rig(model))
    assert out.tokens[0, 5:].tolist() == [((p - 1) % 30) + 2 for p in range(5, 11)]


# --- ARM ------------------------------------------------------------------------------------------

def test_arm_greedy_matches_a_plain_loop():
    model = model_for("arm")
    out = model.generate(PROMPT, gen_length=5)
    x = PROMPT.clone()
    for _ in range(5):
        x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.tokens, x)
    assert out.trajectory.commit_step[0, 5:].tolist() == [0, 1, 2, 3, 4]
    assert out.causal


# --- step hooks and state --------------------------------------------------------------------------

def test_step_hooks_fire_exactly_on_chosen_steps():
    model = model_for()
    fired = {"plain": [], "bound": [], "every": [], "block": []}

    def spy(key):
        def fn(x, hook):
            fired[key].append(model.state.step)
        return fn

    model.generate(PROMPT, steps=8, gen_length=8, block_length=4, hook_steps=[0, 3, -1],
                   fwd_hooks=[("hook_embed", spy("plain")), ("hook_embed", at_steps(spy("bound"), [1, "last"])),
                              at_steps(spy("every"), steps(every=3), name="hook_embed"),
                              at_steps(spy("block"), steps(blocks=[1]), name="hook_embed")])
    assert fired["plain"] == [0, 3, 7]
    assert fired["bound"] == [1, 7]
    assert fired["every"] == [0, 3, 6, 7]
    assert fired["block"] == [4, 5, 6, 7]


def test_state_is_visible_to_hooks():
    model = model_for()
    masked = []
    model.generate(PROMPT, steps=4, gen_length=4,
                   fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: masked.append(int(model.state.masked[0].sum())))])
    assert masked == [4, 3, 2, 1]
    assert model.state is None  # cleared after the run


def test_hooks_are_removed_when_a_step_raises():
    model = model_for()

    def boom(x, hook):
        if model.state.step == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.generate(PROMPT, steps=4, gen_length=4, fwd_hooks=[("blocks.*.attn.hook_pattern", boom)],
                       record=[ReceivedAttention()])
    assert all(not hp.has_hooks() for hp in model.hook_points()) and model.state is None


def test_hook_names_are_checked_before_compute():
    model = model_for()
    calls = []
    model.add_hook("hook_embed", lambda x, hook: calls.append(1), is_permanent=True)
    try:
        with pytest.raises(HookNameError):
            model.generate(PROMPT, steps=4, gen_length=4, fwd_hooks=[("blocks.0.attn.hook_patern", print)])
        with pytest.raises(HookNameError):
            model.generate(PROMPT, steps=4, gen_length=4, fwd_hooks=[("blocks.9.*", print)])
        assert calls == []
    finally:
        model.reset_hooks(including_permanent=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=8, gen_length=10, block_length=4), "multiple of block_length"),
    (dict(steps=7, gen_length=8, block_length=4), "divisible by the number of blocks"),
    (dict(steps=8, gen_length=60), "exceeds the context"),
    (dict(steps=8, gen_length=8, remasking="lowest"), "remasking"),
    (dict(steps=8, gen_length=8, sampler="arm"), "causal model"),
    (dict(steps=8, gen_length=8, sampler="dream", alg="greedy"), "alg=.greedy. is invalid"),
    (dict(steps=8, gen_length=8, hook_steps=[9]), "step of a run of 8 steps"),
])
def test_inconsistent_settings_fail_before_compute(kwargs, match):
    model = model_for()
    with pytest.raises(SamplerConfigError, match=match):
        model.generate(PROMPT, **kwargs)


def test_arm_needs_one_step_per_token():
    with pytest.raises(SamplerConfigError, match="one step per token"):
        model_for("arm").generate(PROMPT, steps=4, gen_length=8)


# --- trajectory cache and reducers -----------------------------------------------------------------

def test_cache_at_first_and_last_step():
    model = model_for()
    out = model.generate(PROMPT, steps=8, gen_length=8, cache="blocks.0.attn.hook_pattern" @ steps(0, -1))
    assert out.cache.steps == [0, 7]
    stacked = out.cache.stack("blocks.0.attn.hook_pattern")
    assert stacked.shape == (2, 2, 4, 13, 13)
    assert out.cache[-1]["pattern", 0].shape == (2, 4, 13, 13)  # a TL ActivationCache per step
    # the cached step-0 pattern is the pattern of a plain forward on the step-0 input
    _, ref = model.run_with_cache(out.trajectory.x_steps[0], names_filter="blocks.0.attn.hook_pattern")
    torch.testing.assert_close(stacked[0], ref["pattern", 0])


def test_cache_refuses_when_over_budget_before_compute():
    model = model_for()
    forwards = []
    with pytest.raises(MemoryBudgetError, match="ReceivedAttention"):
        model.generate(PROMPT, steps=8, gen_length=8,
                       fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(1))],
                       cache=TrajectoryCache("blocks.*.attn.hook_pattern", budget_bytes=10_000))
    assert forwards == []
    # a block-bound cache is sized before the run too (an upper bound: blocks are known only while sampling)
    with pytest.raises(MemoryBudgetError):
        model.generate(PROMPT, steps=8, gen_length=8, block_length=4,
                       cache=TrajectoryCache("blocks.*.attn.hook_pattern", steps(blocks=[1]), budget_bytes=10_000))


def test_cache_estimate_equals_the_bytes_it_holds():
    """The budget check's estimate is the exact size of what the cache then holds (names × steps × shape)."""
    model = model_for()
    cache = TrajectoryCache(["blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post"], steps(0, 2, 5))
    out = model.generate(PROMPT, steps=8, gen_length=8, cache=cache)
    held = sum(t.numel() * t.element_size() for s in out.cache.steps for t in out.cache[s].values())
    assert out.cache.steps == [0, 2, 5] and held > 0
    assert cache.estimated_bytes == held


@pytest.mark.parametrize("kind", ["llada", "arm"])
@pytest.mark.parametrize("query", ["all", "prompt", "masked", "generated", "committed"])
def test_received_attention_equals_the_full_cache_statistic(kind, query):
    model = model_for(kind)
    if kind == "arm" and query in ("masked", "committed"):
        pytest.skip("an ARM step has no masked rows, and its committed token is no row of its forward (refused)")
    out = model.generate(PROMPT, steps=6, gen_length=6, record=[ReceivedAttention(query=query)],
                         cache="blocks.*.attn.hook_pattern")
    rec = out.records["received_attention"]  # [step, batch, layer, head, key]
    T = out.tokens.shape[1]
    assert rec.shape == (6, 2, 2, 4, T)
    for s in range(6):
        x = out.trajectory.x_steps[s]
        pos = int((x[0] >= 0).sum())  # ARM prefix length at this step
        if query == "all":
            rows = torch.ones(2, pos, dtype=torch.bool)
        elif query == "prompt":
            rows = torch.zeros(2, pos, dtype=torch.bool)
            rows[:, :5] = True
        elif query == "masked":
            rows = x[:, :pos] == MASK
        elif query == "generated":
            rows = torch.arange(pos)[None].expand(2, -1) >= 5
        else:
            rows = out.trajectory.committed_at(s)[:, :pos]
        for layer in range(2):
            pattern = out.cache[s][f"blocks.{layer}.attn.hook_pattern"]  # [b, h, q, k]
            n = rows.sum(-1)[:, None, None]
            expected = (pattern * rows[:, None, :, None]).sum(2) / n.clamp(min=1)
            expected = torch.where(n > 0, expected, torch.full_like(expected, float("nan")))  # no query: undefined
            torch.testing.assert_close(rec[s, :, layer, :, :pos], expected, atol=1e-5, rtol=1e-5, equal_nan=True)
            assert rec[s, :, layer, :, pos:].isnan().all()  # keys the step's prefix did not have yet: NaN
    if query == "all":  # mass shares sum to one over keys
        torch.testing.assert_close(rec.nansum(-1), torch.ones(6, 2, 2, 4))


def test_kv_norms_and_topk_equal_the_full_cache():
    model = model_for()
    out = model.generate(PROMPT, steps=4, gen_length=4, record=[KeyValueNorms(layers=[1]), TopKKeys(k=3, layers=[0])],
                         cache=["blocks.1.attn.hook_rot_k", "blocks.1.attn.hook_v", "blocks.0.attn.hook_pattern"])
    for s in range(4):
        c = out.cache[s]
        torch.testing.assert_close(out.records["key_norms"][s, :, 0], c["blocks.1.attn.hook_rot_k"].norm(dim=-1).transpose(1, 2))
        torch.testing.assert_close(out.records["value_norms"][s, :, 0], c["blocks.1.attn.hook_v"].norm(dim=-1).transpose(1, 2))
        vals, idx = c["blocks.0.attn.hook_pattern"].topk(3, dim=-1)
        torch.testing.assert_close(out.records["topk_attention"][s, :, 0], vals)
        assert torch.equal(out.records["topk_keys"][s, :, 0], idx)
    assert out.record_meta["key_norms"]["layers"] == [1]


def test_reducer_at_chosen_steps_only():
    model = model_for()
    out = model.generate(PROMPT, steps=8, gen_length=8, record=[ReceivedAttention(when=steps(0, -1), name="ends"),
                                                                 ReceivedAttention(query="masked")])
    assert out.records["ends"].shape[0] == 2 and out.record_meta["ends"]["steps"] == [0, 7]
    assert out.records["received_attention"].shape[0] == 8


def test_summary_is_readable():
    text = repr(model_for().generate(PROMPT, steps=4, gen_length=4, record=[ReceivedAttention()]))
    assert "sampler=llada" in text and "commits per step" in text and "received_attention" in text
