"""Held-out audit of the block-family probes: knockout hooks on replays and other samplers, block-length
arguments, the block nulls, replayed activations, the run's record width and the masked residual means."""

from __future__ import annotations

import torch
from test_family_patch import models  # noqa: F401  (the module's tiny LLaDA2 / SDAR fixture)

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
