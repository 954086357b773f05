"""The floating probes on DiffusionGemma runs: planted anchors are found over steps (absent keys are
never anchors), the QK split at a step equals its closed form, and whole-sequence probes refuse clearly."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import ReceivedAttention, steps
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.probes import qk_at_step
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import InputError
from mdm_lens.probes import run


@pytest.fixture(scope="module")
def bridge():
    return TransformersBridge(tiny_diffusion_gemma(seed=1))


def _ids():
    return torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(0))


def test_planted_anchor_is_found_at_every_step(bridge):
    def plant(pattern, hook):  # every canvas query of layer 1 attends to key 2 only
        planted = torch.zeros_like(pattern)
        planted[..., 2] = 1.0
        return planted

    out = bridge.generate(_ids(), seed=2, max_new_tokens=16, max_denoising_steps=3, record=[ReceivedAttention()],
                          fwd_hooks=[("blocks.1.attn.hook_pattern", plant)])
    sa = run.anchors_over_steps(out, layer=1)
    assert sa.anchors.shape == (2, 6, 21)
    expected = torch.zeros(2, 6, 21, dtype=torch.bool)
    expected[..., 2] = True
    assert torch.equal(sa.anchors, expected)
    assert sa.received[:, :3, 13:].isnan().all()  # canvas 1 does not exist during canvas 0's steps
    drift = run.drift_from_output(out, layer=1)
    assert torch.allclose(torch.as_tensor(drift.mean_jaccard, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    # unplanted layer 0 is a real, different distribution
    assert not torch.equal(run.anchors_over_steps(out, layer=0).anchors, expected)


def test_qk_at_step_equals_closed_form(bridge):
    names = [f"blocks.1.attn.{n}" for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    out = bridge.generate(_ids(), seed=3, max_new_tokens=16, max_denoising_steps=3, cache=names @ steps(1, 4))
    for step, n_keys in ((1, 13), (4, 21)):
        res = qk_at_step(out, step, layer=1)
        c = out.cache[step]
        q = c["blocks.1.attn.hook_rot_q"].double()
        k = c["blocks.1.attn.hook_rot_k"].double()
        assert k.shape[1] == n_keys
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        dots = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        for b in range(2):
            a = int(res.anchor[b, 0])
            rest = torch.cat([dots[b, ..., :a], dots[b, ..., a + 1:]], dim=-1)
            expected = (dots[b, ..., a : a + 1] - rest).mean(-1).mean(-1)
            assert torch.allclose(res.advantage[b], expected, atol=1e-10)
        assert torch.allclose(res.norm_term + res.angle_term, res.advantage)
    with pytest.raises(InputError, match="cached at step 2"):
        qk_at_step(out, 2, layer=1)


def test_whole_sequence_probes_refuse_clearly(bridge):
    tokens = torch.randint(0, 128, (1, 12))
    with pytest.raises(InputError, match="do not apply"):
        run.absorption_by_layer(bridge, tokens)
    with pytest.raises(InputError, match="do not apply"):
        run.qk_at_layer(bridge, tokens, layer=0)
