"""Held-out audit of the block-family probes: knockout hooks on replays and other samplers, block-length
arguments, the block nulls, replayed activations, the run's record width and the masked residual means."""

from __future__ import annotations

import pytest
import torch
from test_family_patch import models  # noqa: F401  (the module's tiny LLaDA2 / SDAR fixture)
from test_fastdllm_v2 import write_fastdllm_v2

from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.probes._knockout_hooks import KnockoutHooks
from mdm_lens.probes.absorption import absorption_from_received
from mdm_lens.probes.received import visibility_mask
from mdm_lens.probes.run import anchors_over_steps, drift_from_output
from mdm_lens.sweep.feature_tables import masked_mean_residuals


def _pattern_grab(store: dict, model):
    def grab(pattern, hook):
        st = model.state
        store[st.step] = (pattern.detach().clone(), int(st.extra["query_start"]), int(st.extra["query_end"]))
    return grab


def test_sdar_replayed_knockout_is_the_knockout_the_sampler_applied(models):
    model = models["sdar"]
    prompt = torch.randint(0, 90, (1, 5), generator=torch.Generator().manual_seed(1))
    run, kh = {}, KnockoutHooks(model, [0], [0], "masked", prompt_length=5)
    out = model.generate(prompt, sampler="sdar", gen_length=8, block_length=4,
                         fwd_hooks=kh.hooks() + [("blocks.0.attn.hook_pattern", _pattern_grab(run, model))])
    denoise = [s for s in range(out.n_steps) if out.state_at(s).extra["kind"] == "denoise"]
    assert any(run[s][1] > 4 for s in denoise)  # mid-run blocks: query_start past the first block
    for s in denoise:
        ran, q0, q1 = run[s]
        rep = {}
        kh2 = KnockoutHooks(model, [0], [0], "masked", prompt_length=5)
        out.replay(model, s, fwd_hooks=kh2.hooks() + [("blocks.0.attn.hook_pattern", _pattern_grab(rep, model))])
        replayed = rep[s][0][:, :, q0:q1]
        assert replayed.shape == ran.shape
        assert (replayed - ran).abs().max() <= 1e-5, s
        masked = out.state_at(s).masked[0, q0:q1]
        assert masked.any()
        assert float(ran[0, :, masked, 0].abs().max()) == 0.0  # the sampler cut key 0 from the masked block rows


def test_fastdllm_v2_anchor_knockout_prepass_is_the_forward_it_cuts(tmp_path):
    """fastdllm_v2 states carry the forward's block mask (`block_length`), so the anchors' pre-pass runs inside its
    generate, and its scores on the forward's rows are the forward's own unablated scores."""
    folder = write_fastdllm_v2(tmp_path)[0]
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    kh = KnockoutHooks(model, [1], "anchors", "masked", prompt_length=3)
    pre, real = {}, {}

    def grab(scores, hook):  # runs before the knockout hook: both see unablated scores
        st = model.state
        (pre if kh._prepass else real).setdefault(st.step, []).append(
            (scores.detach().clone(), int(st.extra["query_start"]), int(st.extra["query_end"])))

    out = model.generate([[20, 21, 22]], sampler="fastdllm_v2", block_size=4, small_block_size=4,
                         max_new_tokens=8, stop_token=95, pad_id=0, fwd_hooks=[("blocks.1.attn.hook_attn_scores", grab)]
                         + kh.hooks())
    assert out.n_steps == len(real) == len(pre) > 2
    for s in real:
        (r, lo, hi), = real[s]
        (p, _, _), = pre[s]
        assert p.shape[-1] == r.shape[-1] == hi
        torch.testing.assert_close(p[:, :, lo:hi], r, atol=1e-5, rtol=0)
    with pytest.raises(InputError, match="use_block_cache"):
        model.generate([[20, 21, 22]], sampler="fastdllm_v2", block_size=4, small_block_size=2, max_new_tokens=8,
                       stop_token=95, pad_id=0, use_block_cache=True,
                       fwd_hooks=KnockoutHooks(model, [0], "anchors", prompt_length=3).hooks())


@pytest.mark.parametrize("bl", [0, -2, 2.5, True])
def test_visibility_mask_validates_block_length(bl):
    with pytest.raises(ArgumentTypeError if isinstance(bl, (bool, float)) else ArgumentError, match="block_length"):
        visibility_mask(4, 4, block_length=bl)


def test_absorption_nulls_without_and_with_a_block_mask(models):
    model = models["llada2"]
    r = torch.softmax(torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0)), -1)
    saved = model.cfg.extra.pop("block_length")
    try:  # a bidirectional model (no block mask) with more keys than any default block: the plain 1/n null
        res = absorption_from_received(model, r, None, "default", "zscore", False, [0])
    finally:
        model.cfg.extra["block_length"] = saved
    assert res.block_length is None
    assert float(res.null_mean[0, 0]) == pytest.approx(100 / 40, abs=1e-9)
    # paper mode on the block-causal SDAR (blocks of 4), 8 keys: key 0 gets 1/4 from queries 0-3, 1/8 from 4-7
    r8 = torch.softmax(torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0)), -1)
    res = absorption_from_received(models["sdar"], r8, None, "paper", "zscore", False, [0])
    assert float(res.null_mean[0, 0]) == pytest.approx(100 * (4 / 4 + 4 / 8) / 8, abs=1e-9)


def _llada2_run(model, **kw):
    prompt = torch.randint(0, 90, (1, 5), generator=torch.Generator().manual_seed(2))
    return model.generate(prompt, sampler="llada2", gen_length=8, steps=4, block_length=4, **kw)


def test_llada2_replay_activations_and_state_are_the_runs(models):
    model, run = models["llada2"], {}

    def grab(t, hook):
        run[model.state.step] = t.detach().clone()
    out = _llada2_run(model, fwd_hooks=[("blocks.0.attn.hook_rot_k", grab)])
    assert out.state_at(1).extra["block_length"] == 4
    for s in range(out.n_steps):
        rep = {}
        out.replay(model, s, fwd_hooks=[("blocks.0.attn.hook_rot_k", lambda t, hook: rep.__setitem__("k", t))])
        assert rep["k"].shape == run[s].shape
        assert (rep["k"] - run[s]).abs().max() <= 1e-5, s  # rotated keys see absolute positions (logits do not)


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_anchor_prepass_is_the_block_forward_it_cuts(models, name):
    """The pre-pass of a block run's step: the canvas up to the forward's end, the run's block mask, no KV cache;
    its layer-1 scores on the forward's rows are the forward's own unablated scores."""
    model = models[name]
    kh = KnockoutHooks(model, [1], "anchors", "all", prompt_length=5)
    pre, real = {}, {}

    def grab(scores, hook):  # before the knockout hook: the forward's unablated scores
        (pre if kh._prepass else real)[model.state.step] = (scores.detach().clone(), int(model.state.extra["query_end"]))
    hooks = [("blocks.1.attn.hook_attn_scores", grab)] + kh.hooks()
    if name == "llada2":
        out = _llada2_run(model, fwd_hooks=hooks)
    else:
        prompt = torch.randint(0, 90, (1, 5), generator=torch.Generator().manual_seed(2))
        out = model.generate(prompt, sampler="sdar", gen_length=12, block_length=4, fwd_hooks=hooks)
    assert len(real) == out.n_steps and any(end < out.tokens.shape[1] for _, end in real.values())
    for s, (r, end) in real.items():
        p = pre[s][0]
        assert p.shape[-1] == r.shape[-1] == end and p.shape[-2] == end
        torch.testing.assert_close(p[..., end - r.shape[-2]:end, :], r, atol=1e-5, rtol=0)  # -inf = masked


def test_block_run_record_width_and_masked_means(models):
    model = models["llada2"]
    out = _llada2_run(model, record=[ReceivedAttention()])
    assert out.tokens.shape[1] == 13 and out.records["received_attention"].shape[-1] == 16  # canvas of 4 blocks
    assert anchors_over_steps(out, layer=0).anchors.shape[-1] == 13
    drift_from_output(out, layer=0)  # commit_step has the output's 13 keys
    pooled, n, k = masked_mean_residuals(model, out)  # n: every masked canvas position; k: the pooled ones
    for s, f in enumerate(out.trajectory.forwards):
        end, x = f["extra"]["query_end"], out.trajectory.x_steps[s]
        pos = [p for p in range(5, min(end, x.shape[-1])) if x[0, p] == model.cfg.mask_token_id]
        assert int(k[s, 0]) == len(pos), s
        assert int(n[s, 0]) == int((x[0, 5:] == model.cfg.mask_token_id).sum()), s
        grab = {}
        out.replay(model, s, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: grab.__setitem__("r", t))])
        if pos:
            assert (grab["r"][0, pos].float().mean(0) - pooled[s, 1, 0]).abs().max() <= 1e-4, s
        else:
            assert bool(pooled[s, 1, 0].isnan().all())
