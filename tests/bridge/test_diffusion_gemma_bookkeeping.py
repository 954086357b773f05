"""DiffusionGemma's per-step bookkeeping agrees with itself (issue 21): a position is committed once, at the step
whose argmax fixes it (a canvas's last step for its row, or the step adaptive stopping finishes the row);
`n_committed`, `commit_step`, `state.masked` / `state.committed` and the reducers follow that one definition,
and `accepted` (the per-step keep set) is recorded apart. Plus the crashes of issue 21 on this model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdm_lens import KeyValueNorms, ReceivedAttention, at_steps, steps
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import InputError, NonFiniteError

P = 5  # prompt length


@pytest.fixture(scope="module")
def bridge():
    return TransformersBridge(tiny_diffusion_gemma(seed=0))


def _ids(batch=2, seed=0):
    return torch.randint(2, 128, (batch, P), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(new=st.sampled_from([8, 16]), n_steps=st.integers(1, 4), bound=st.sampled_from([0.1, 1.0, 5.0]),
       stop=st.sampled_from([None, (0, 50.0), (1, 5.0), (1, 1e-3)]), eos=st.booleans(), freeze=st.booleans(),
       seed=st.integers(0, 20))
def test_each_position_is_committed_once_and_every_field_agrees(bridge, new, n_steps, bound, stop, eos, freeze, seed):
    kw = dict(max_new_tokens=new, max_denoising_steps=n_steps, entropy_bound=bound, t_min=0.3, t_max=0.9)
    if stop is None:
        kw.update(stability_threshold=None, confidence_threshold=None)
    else:
        kw.update(stability_threshold=stop[0], confidence_threshold=stop[1])
    if eos:
        kw.update(eos_token_id=list(range(0, 128, 3)), pad_token_id=1)
    seen = {}

    def spy(x, hook):
        s = bridge.state
        seen[s.step] = (s.block, s.extra["canvas_start"], s.masked.clone())

    hooks = [("blocks.0.hook_resid_pre", spy)] + ([_freeze_row0()] if freeze else [])
    out = bridge.generate(_ids(seed=seed), seed=seed, fwd_hooks=hooks,
                          record=[ReceivedAttention(query="committed", name="ra_c")], **kw)
    t = out.trajectory
    cs, n = t.commit_step, t.n_committed
    assert (cs[:, :P] == -1).all() and (cs[:, P:] >= 0).all() and (cs[:, P:] < t.n_steps).all()  # once each
    for s in range(t.n_steps):
        assert torch.equal(n[s], (cs == s).sum(-1))
        block, start, masked = seen[s]
        canvas = cs[:, start:start + masked.shape[1]]
        assert torch.equal(masked, canvas >= s)  # not committed yet <=> committed at s or later
        assert int(t.block_of_step[s]) == block
    # a canvas's positions of one row are fixed together, at a step of that canvas
    for start in range(P, cs.shape[1], 8):
        canvas = cs[:, start:start + 8]
        assert (canvas == canvas[:, :1]).all()
        assert all(int(t.block_of_step[c]) == (start - P) // 8 for c in canvas[:, 0].tolist())
    assert torch.isfinite(t.commit_confidence[:, P:]).all() and t.commit_confidence[:, :P].isnan().all()
    # without stopping every row runs the whole budget: the commits are at each canvas's last step
    if stop is None and not eos:
        assert (cs[:, P:] == (torch.arange(cs.shape[1] - P) // 8 + 1) * n_steps - 1).all()
    # accepted: the per-step keep set, on the canvas only, at least one sample per active step
    assert t.accepted.shape == t.x_steps.shape and not t.accepted[..., :P].any()
    # the committed-rows reducer has mass exactly at the steps that commit
    mass = out.records["ra_c"].nansum(-1)[..., 0, 0]  # [step, batch]
    assert torch.allclose(mass, (n > 0).float(), atol=1e-5)
    assert f"commits per step (row 0): {n[:, 0].tolist()}" in repr(out) and "accepted per step" in repr(out)


def test_an_adaptively_stopped_row_commits_when_it_stops(bridge):
    # threshold 0 = always stable, a confidence bound every row meets at once: one step per canvas
    out = bridge.generate(_ids(), seed=1, max_new_tokens=16, max_denoising_steps=4, stability_threshold=0,
                          confidence_threshold=50.0)
    assert out.trajectory.n_committed.tolist() == [[8, 8], [8, 8]]
    assert out.trajectory.commit_step[:, P:].tolist() == [[0] * 8 + [1] * 8] * 2


def _freeze_row0():
    """Row 0's final hidden state made constant: its argmax is stable from step 1, so with a confidence bound every
    row meets, row 0 stops at each canvas's second step while row 1 runs the whole budget."""
    const = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 1000

    def fix(x, hook):
        x = x.clone()
        x[0] = const
        return x

    return ("ln_final.hook_out", fix)


def test_rows_that_stop_at_different_steps_commit_at_their_own_step(bridge):
    seen = []

    def spy(x, hook):
        seen.append(bridge.state.masked.sum(-1).tolist())

    out = bridge.generate(_ids(), seed=0, max_new_tokens=16, max_denoising_steps=4, stability_threshold=1,
                          confidence_threshold=5.0, t_min=0.3, t_max=0.9,
                          fwd_hooks=[_freeze_row0(), ("blocks.0.hook_resid_pre", spy)])
    t = out.trajectory
    assert t.commit_step[:, P:].tolist() == [[1] * 8 + [5] * 8, [3] * 8 + [7] * 8]
    assert t.n_committed.tolist() == [[0, 0], [8, 0], [0, 0], [0, 8], [0, 0], [8, 0], [0, 0], [0, 8]]
    # row 0 is not masked any more once it stopped (its argmax is held), row 1 until its canvas's last step
    assert seen == [[8, 8], [8, 8], [0, 8], [0, 8]] * 2


def test_kv_norms_with_different_kv_head_counts_per_layer(bridge):
    out = bridge.generate(_ids(), seed=0, max_new_tokens=8, max_denoising_steps=2, record=[KeyValueNorms()])
    k, v = out.records["key_norms"], out.records["value_norms"]
    heads = out.record_meta["key_norms"]["kv_heads"]
    assert len(set(heads)) > 1  # the tiny model mixes layer types, as the real one does
    assert k.shape == (2, 2, 3, max(heads), P + 8) and v.shape == k.shape
    for layer, h in enumerate(heads):
        assert torch.isfinite(k[:, :, layer, :h]).all() and torch.isnan(k[:, :, layer, h:]).all()
        # the layer's own key norms, from a hook on the same step
    seen = {}

    def grab(x, hook):
        seen[hook.name] = x.detach().float().norm(dim=-1).transpose(1, 2)

    out2 = bridge.generate(_ids(), seed=0, max_new_tokens=8, max_denoising_steps=2, record=[KeyValueNorms()],
                           fwd_hooks=[at_steps(grab, [1], name="blocks.1.attn.hook_rot_k")])
    torch.testing.assert_close(out2.records["key_norms"][1, :, 1, :heads[1]], seen["blocks.1.attn.hook_rot_k"])


def test_prompt_ids_outside_the_vocabulary_are_an_input_error(bridge):
    for bad in (128, 10**6, -1):
        ids = _ids()
        ids[1, 2] = bad
        with pytest.raises(InputError, match=rf"token id {bad} at \[row 1, position 2\].*\[0, 127\]"):
            bridge.generate(ids, max_new_tokens=8)


def test_non_finite_decoder_logits_raise_at_the_step(bridge):
    def nan(x, hook):
        return x * float("nan")

    with pytest.raises(NonFiniteError, match=r"denoising step 1 \(phase 'cond'\)"):
        bridge.generate(_ids(), max_new_tokens=8, max_denoising_steps=3,
                        fwd_hooks=[at_steps(nan, [1], name="blocks.2.hook_resid_post")])
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())


def test_wrong_shape_hook_on_the_bridge_names_the_hook(bridge):
    def bad(x, hook):
        return x[..., :3]

    with pytest.raises(InputError, match=r"hook on blocks\.0\.hook_resid_mid returned shape .*expected"):
        bridge.generate(_ids(), max_new_tokens=8, max_denoising_steps=2, fwd_hooks=[("blocks.0.hook_resid_mid", bad)])
    with pytest.raises(InputError, match=r"hook on encoder\.0\.hook_resid_post returned shape"):
        bridge.generate(_ids(), max_new_tokens=8, max_denoising_steps=2,
                        fwd_hooks=[("encoder.0.hook_resid_post", at_steps(bad, steps(phases=("encoder",))))])


def test_selectors_that_never_fire_on_this_model_are_refused(bridge):
    from mdm_lens.errors import SamplerConfigError

    with pytest.raises(SamplerConfigError, match=r"blocks\[0\]=2 does not exist: this run has 2 block"):
        bridge.generate(_ids(), max_new_tokens=16, max_denoising_steps=2, cache="blocks.0.hook_resid_post" @ steps(blocks=[2]))
    with pytest.raises(SamplerConfigError, match="never run"):
        bridge.generate(_ids(), max_new_tokens=8, max_denoising_steps=2,
                        cache="blocks.0.hook_resid_post" @ steps(phases=("uncond",)))
    out = bridge.generate(_ids(), max_new_tokens=8, max_denoising_steps=2,
                          cache="encoder.0.hook_resid_post" @ steps(phases=("encoder",)))
    assert out.cache.steps == [0] and out.cache[0]["encoder.0.hook_resid_post"].shape == (2, P, 32)
