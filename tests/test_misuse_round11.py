"""Held-out misuse findings, round eleven (misuse22's U4 and the runs after it): each test fails on the code before
its fix."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def arm():
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-arm")


def test_arm_aligned_stack_is_as_wide_as_the_canvas(arm):
    # ARM's forwards never feed back the token they commit last, so the widest forward is one position short of the
    # canvas; align=True promises canvas-shaped tensors (to sit beside out.tokens and the records' key axis)
    from mdm_lens import ReceivedAttention

    out = arm.generate(torch.tensor([[9, 29, 33, 35, 13, 14]]), gen_length=4, record=[ReceivedAttention()],
                       cache=["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"])
    width = out.tokens.shape[1]
    assert out.records["received_attention"].shape[-1] == width == 10
    resid = out.cache.stack("blocks.0.hook_resid_post", align=True)
    pattern = out.cache.stack("blocks.0.attn.hook_pattern", align=True)
    assert resid.shape == (4, 1, width, arm.cfg.d_model) and pattern.shape[-2:] == (width, width)
    # step s computed positions [0, 6 + s): the rest (the last position at every step) is NaN, the rows are exact
    computed = ~resid[:, 0, :, 0].isnan()
    assert computed.sum(-1).tolist() == [6, 7, 8, 9] and not computed[:, -1].any()
    for s in range(4):
        assert torch.equal(resid[s, :, : 6 + s], out.cache[s]["blocks.0.hook_resid_post"])
