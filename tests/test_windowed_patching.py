"""Patching and attribution patching on the windowed samplers (BD3LM, Nemotron): a BD3LM step without KV cache whose
window starts at 0 is one plain forward of the canvas at the step's σ (the probes run it exactly); a step that read a
KV cache, or a window that slid past the prompt, is no such forward: NaN with the reason (AtP) or a typed refusal."""

from __future__ import annotations

import math

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import StepForwardError
from mdm_lens.probes.attribution import atp_vs_patching, attribution_patching
from mdm_lens.probes.patching import matched_canvases, patch_anchor_activations
from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm
from tests.families.nemotron_fixture import write_nemotron

PROMPT, CORRUPT = torch.tensor([[7, 9, 11, 3, 5]]), torch.tensor([[8, 9, 12, 3, 6]])


@pytest.fixture(scope="module")
def bd3_tc(tmp_path_factory):  # time-conditioned: a forward without the step's σ gives other logits
    folder, _ = write_bd3lm(tmp_path_factory.mktemp("bd3w"), dict(BD3LM_CONFIG, time_conditioning=True), seed=4)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_each_step_canvas_forward_is_the_forward_the_run_ran(bd3_tc):
    model = bd3_tc
    out = model.generate(PROMPT, gen_length=11, steps=6, first_hitting=False, seed=1)
    reused = [s for s in range(out.n_steps) if out.trajectory.forwards[s]["extra"].get("reused_from") is not None]
    assert reused  # the case where the step's forward is an earlier step's, at that step's σ
    for s in range(out.n_steps):
        m = matched_canvases(out, CORRUPT, s, model=model)
        f = out.trajectory.forwards[s]
        source = f["extra"].get("reused_from", s)
        ran = out.replay(model, source)
        lo, end = f["block_slice"].start, f["keys"].stop
        assert m.clean.shape[1] == end and set(m.forward_kwargs) == {"sigma"}
        got = model(m.clean, **m.forward_kwargs)[:, lo:end]
        want = ran[:, -(end - lo):]
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
        other = m.forward_kwargs["sigma"] + 0.5  # σ matters: the kwargs must carry the step's own
        assert not torch.allclose(model(m.clean, sigma=other)[:, lo:end], want, atol=1e-3)


def test_exact_patching_of_every_position_reaches_the_corrupted_run(bd3_tc):
    # noising at layer 0's resid_pre over all positions is the corrupted forward: effect = corrupt − clean exactly
    out = bd3_tc.generate(PROMPT, gen_length=11, steps=4, seed=2)
    r = atp_vs_patching(bd3_tc, out, CORRUPT, components=["resid_pre"], layers=[0])
    defined = [i for i, why in enumerate(r.reason) if why == ""]
    assert len(defined) >= 2
    for i in defined:
        want = r.corrupt_value[i] - r.clean_value[i]
        assert abs(float(r.exact["resid_pre"][i, 0]) - want) <= 1e-4 * max(1.0, abs(want))
        assert math.isfinite(float(r.estimates["resid_pre"][i, 0]))


def test_cached_and_slid_windows_are_nan_with_the_reason(bd3_tc):
    cached = bd3_tc.generate(PROMPT, gen_length=11, steps=4, kv_cache=True, seed=0)
    with pytest.raises(StepForwardError, match="KV cache"):
        matched_canvases(cached, CORRUPT, 1, model=bd3_tc)
    slid = bd3_tc.generate(PROMPT, gen_length=23, steps=2, seed=0)  # 28 tokens > model_length 16: the window slides
    r = attribution_patching(bd3_tc, slid, CORRUPT, components=["resid_pre"])
    starts = [f["keys"].start for f in slid.trajectory.forwards]
    for i, start in enumerate(starts):
        if start > 0:
            assert "window" in r.reason[i] and bool(r.estimates["resid_pre"][i].isnan().all())
    assert any(s > 0 for s in starts) and any(why == "" for why in r.reason)


def test_nemotron_steps_are_refused_naming_the_cache(tmp_path):
    folder, _, _ = write_nemotron(tmp_path / "n")
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    out = model.generate(PROMPT, gen_length=8, sampler="nemotron", seed=0)
    r = attribution_patching(model, out, CORRUPT, components=["resid_pre"])
    assert all("KV cache" in why for why in r.reason) and bool(r.estimates["resid_pre"].isnan().all())
    with pytest.raises(StepForwardError, match="nemotron"):
        patch_anchor_activations(model, PROMPT, CORRUPT, step=1, gen_length=8, sampler="nemotron")


def test_sdar_prefill_step_is_no_canvas_to_patch(tmp_path):
    # a prompt of 6 with blocks of 4: step 0 prefills [0, 4), inside the prompt; it used to crash the pair's build
    from tests.families.family_checkpoints import write_sdar

    model = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]))
    out = model.generate(torch.tensor([[1, 5, 7, 9, 11, 13]]), gen_length=8, sampler="sdar", block_length=4, steps=4)
    with pytest.raises(StepForwardError, match="prefill"):
        matched_canvases(out, torch.tensor([[1, 6, 7, 9, 11, 13]]), 0, model=model)
    r = attribution_patching(model, out, "knockout", components=["resid_pre"])
    assert "prefill" in r.reason[0] and bool(r.estimates["resid_pre"][0].isnan().all())
    assert any(why == "" for why in r.reason[1:])
