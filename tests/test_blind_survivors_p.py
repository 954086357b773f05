"""Survivors of blind mutation list P (written on 1154caf by a helper who never read tests/): each test fails on
its mutant, checked by applying it."""

from __future__ import annotations

import pytest
import torch

from mdm_lens.errors import InputError


@pytest.fixture(scope="module")
def tiny():
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_a_hook_returning_the_same_elements_in_another_shape_is_refused(tiny):
    # the check compares shapes, not element counts: [1, pos, d] returned as [pos, d] or [1, d, pos] (a transpose
    # the user forgot to undo) must be named at the hook, not broadcast or fail deep inside the next op
    tokens = tiny.to_tokens("Q: what is the capital?")
    for reshape in (lambda x: x.reshape(x.shape[1], x.shape[2]), lambda x: x.transpose(1, 2).contiguous(),
                    lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[1])):
        with pytest.raises(InputError) as e:
            tiny.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: reshape(x))])
        assert e.value.argument == "fwd_hooks" and "blocks.1.hook_resid_post" in str(e.value)
        with pytest.raises(InputError):
            tiny.generate(tokens, steps=2, gen_length=2,
                          fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: reshape(x))])
    same = tiny.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: x.clone())])
    assert torch.allclose(same, tiny(tokens), atol=1e-6)


def test_a_cache_over_two_phases_is_budgeted_for_both(tiny):
    # LLaDA with cfg_scale > 0 runs a cond and an uncond forward per step: a cache of both phases holds twice the
    # rows of one, and the budget check must count them (a cache budgeted for one phase would exceed its budget)
    from mdm_lens import steps
    from mdm_lens.errors import MemoryBudgetError
    from mdm_lens.hooks.trajectory import TrajectoryCache

    prompt = tiny.to_tokens("Q: what is the capital?")
    name = "blocks.0.hook_resid_post"
    run = dict(steps=4, gen_length=4, cfg_scale=1.0)
    one = TrajectoryCache(name, steps())
    tiny.generate(prompt, cache=one, **run)
    both = TrajectoryCache(name, steps(phases=("cond", "uncond")))
    out = tiny.generate(prompt, cache=both, **run)
    assert both.estimated_bytes == 2 * one.estimated_bytes > 0
    assert out.cache.stack(name, phase="uncond").shape[0] == 4 == out.cache.stack(name, phase="cond").shape[0]
    with pytest.raises(MemoryBudgetError):
        tiny.generate(prompt, cache=TrajectoryCache(name, steps(phases=("cond", "uncond")),
                                                    budget_bytes=one.estimated_bytes * 3 // 2), **run)
