"""Held-out audit of the block-family probes: knockout hooks on replays and other samplers, block-length
arguments, the block nulls, replayed activations, the run's record width and the masked residual means."""

from __future__ import annotations

import pytest
import torch
from test_family_patch import models  # noqa: F401  (the module's tiny LLaDA2 / SDAR fixture)
from test_fastdllm_v2 import write_fastdllm_v2

from mdm_lens import HookedMDM
from mdm_lens.errors import InputError
from mdm_lens.probes._knockout_hooks import KnockoutHooks


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
    kh = KnockoutHooks(model, [0, 1], "anchors", "masked", prompt_length=3)
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
        assert (p[:, :, lo:hi] - r).abs().max() <= 1e-5, s
    with pytest.raises(InputError, match="use_block_cache"):
        model.generate([[20, 21, 22]], sampler="fastdllm_v2", block_size=4, small_block_size=2, max_new_tokens=8,
                       stop_token=95, pad_id=0, use_block_cache=True,
                       fwd_hooks=KnockoutHooks(model, [0], "anchors", prompt_length=3).hooks())
