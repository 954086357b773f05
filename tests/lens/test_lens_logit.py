"""The logit lens over denoising steps: at the last layer it is the step's own logits (LLaDA twin and a Dream-style
model with the logit shift), the cache and replay sources agree, an identity tuned lens is the logit lens, tidy
frames, and typed errors for bad arguments."""

import math

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError
from mdm_lens.lens import LensTrace, TunedLens, lens_logits, lens_trace

from ._lensfix import GEN, dream_model, run, twin_prompts


@pytest.fixture(scope="module")
def twin_run(mdm):
    ids, am = twin_prompts(mdm)
    return mdm, run(mdm, ids, am)


@pytest.fixture(scope="module")
def dream_run():
    model = dream_model()
    ids = torch.tensor([[0, 0, 1, 5, 6, 7], [1, 9, 10, 11, 12, 13]])
    am = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    return model, run(model, ids, am)


@pytest.mark.parametrize("which", ["twin_run", "dream_run"])
def test_last_layer_is_the_steps_logits(which, request):
    model, out = request.getfixturevalue(which)
    last = model.cfg.n_layers - 1
    trace = lens_trace(model, out)
    assert trace.source == "cache" and trace.top1.shape == (GEN, model.cfg.n_layers, 2, GEN)
    canvas = slice(out.prompt_length, None)
    for s in range(out.n_steps):
        step_logits = out.replay(model, s)                                    # what the sampler read at step s
        resid = out.cache[s][f"blocks.{last}.hook_resid_post"]
        torch.testing.assert_close(lens_logits(model, resid, last), step_logits, rtol=0, atol=1e-6)
        ref = step_logits[:, canvas].float()
        final = out.tokens[:, canvas]
        probs = ref.softmax(-1)
        assert torch.equal(trace.top1[s, -1], ref.argmax(-1))
        torch.testing.assert_close(trace.top1_prob[s, -1], probs.max(-1).values, rtol=0, atol=1e-6)
        torch.testing.assert_close(trace.final_prob[s, -1], probs.gather(-1, final[..., None])[..., 0],
                                   rtol=0, atol=1e-6)
        rank = (ref > ref.gather(-1, final[..., None])).sum(-1)
        assert torch.equal(trace.final_rank[s, -1], rank)


def test_dream_lens_reads_the_previous_row(dream_run):
    """Layer 0 of the Dream-style model: the prediction at answer position p comes from residual row p-1."""
    model, out = dream_run
    trace = lens_trace(model, out, layers=[0], steps=[2], positions=[0, 3])
    resid = out.cache[2]["blocks.0.hook_resid_post"]
    rows = torch.tensor([out.prompt_length - 1, out.prompt_length + 2])
    raw = model.unembed(model.ln_final(resid[:, rows]))
    assert torch.equal(trace.top1[0, 0], raw.argmax(-1))


def test_cache_and_replay_agree(twin_run):
    model, out = twin_run
    a = lens_trace(model, out, source="cache")
    b = lens_trace(model, out, source="replay")
    assert (a.source, b.source) == ("cache", "replay")
    assert torch.equal(a.top1, b.top1) and torch.equal(a.final_rank, b.final_rank)
    torch.testing.assert_close(a.final_prob, b.final_prob, rtol=0, atol=1e-6)


def test_identity_tuned_lens_is_the_logit_lens(twin_run):
    model, out = twin_run
    logit = lens_trace(model, out)
    tuned = lens_trace(model, out, lens=TunedLens.identity(model))
    assert tuned.kind == "tuned" and logit.kind == "logit"
    for name in ("top1", "top1_prob", "final_prob", "final_rank"):
        assert torch.equal(getattr(tuned, name), getattr(logit, name)), name


def test_selection_and_masked_flags(twin_run):
    model, out = twin_run
    full = lens_trace(model, out)
    part = lens_trace(model, out, layers=[-1, 1], steps=[5, 0], positions=[7, 2])
    assert part.layers == [3, 1] and part.steps == [0, 5] and part.positions == [7, 2]
    assert torch.equal(part.top1, full.top1[[0, 5]][:, [3, 1]][..., [7, 2]])
    # masked[s, b, p]: not yet committed before step s
    cs = out.trajectory.commit_step[:, out.prompt_length:]
    for s in range(GEN):
        assert torch.equal(full.masked[s], cs >= s)
    assert torch.equal(full.commit_step, cs) and torch.equal(full.final_tokens, out.tokens[:, out.prompt_length:])


def test_tidy_frame_and_accuracy(twin_run):
    model, out = twin_run
    trace = lens_trace(model, out, layers=[0, 3])
    df = trace.to_frame()
    assert len(df) == GEN * 2 * 2 * GEN
    for c in ("batch", "step", "layer", "position", "top1", "final_token", "final_rank", "commit_step"):
        assert str(df[c].dtype) == "Int64", c
    assert (df.correct == (df.top1 == df.final_token)).all()
    row = df[(df.step == 3) & (df.layer == 3) & (df.batch == 1) & (df.position == 5)].iloc[0]
    assert row.top1 == int(trace.top1[3, 1, 1, 5]) and row.masked == bool(trace.masked[3, 1, 5])
    acc = trace.accuracy("masked")
    hit, sel = trace.correct[4, 1, 0], trace.masked[4, 0]
    assert acc[4, 1, 0].item() == pytest.approx(hit[sel].double().mean().item())
    all_acc = trace.accuracy("all")
    assert all_acc[2, 0, 1].item() == pytest.approx(trace.correct[2, 0, 1].double().mean().item())


def test_accuracy_is_nan_when_nothing_is_masked():
    top = torch.zeros(2, 1, 1, 3, dtype=torch.long)
    t = LensTrace("logit", [0, 1], [0], [0, 1, 2], 2, 4, top, top.float(), top.float(), top,
                  torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                  torch.tensor([[[True, False, False]], [[False, False, False]]]))
    acc = t.accuracy("masked")
    assert acc[0, 0, 0].item() == 1.0 and math.isnan(acc[1, 0, 0].item())


def test_bad_arguments_raise_typed_errors(twin_run, arm):
    model, out = twin_run
    with pytest.raises(OutOfRangeError) as e:
        lens_trace(model, out, layers=[4])
    assert e.value.argument == "layers[0]"
    with pytest.raises(OutOfRangeError):
        lens_trace(model, out, steps=[GEN])
    with pytest.raises(OutOfRangeError):
        lens_trace(model, out, positions=[-GEN - 1])
    with pytest.raises(ArgumentTypeError):
        lens_trace(model, out, positions=1.5)
    with pytest.raises(OutOfRangeError):
        lens_trace(model, out, steps=[1, 1 - GEN])                 # the same step twice
    with pytest.raises(ArgumentError):
        lens_trace(model, out, source="disk")
    with pytest.raises(ArgumentTypeError):
        lens_trace(model, out, lens="tuned")
    with pytest.raises(ArgumentTypeError):
        lens_trace(model, "out")
    with pytest.raises(OutOfRangeError):
        lens_logits(model, out.cache[0]["blocks.0.hook_resid_post"], 7)
    with pytest.raises(ArgumentError):
        lens_logits(model, torch.zeros(1, 3, 5), 0)
    plain = model.generate(out.tokens[:1, :out.prompt_length], gen_length=4, steps=4)
    with pytest.raises(InputError):
        lens_trace(model, plain, source="cache")                   # nothing cached
    arm_out = arm.generate(arm.to_tokens("<bos> question :"), gen_length=2)
    with pytest.raises(InputError):
        lens_trace(arm, arm_out)
    with pytest.raises(OutOfRangeError):
        lens_trace(model, out, layers=[0, 1], lens=TunedLens.identity(model, layers=[0]))
    other = HookedMDM.from_config(model.cfg.__class__(d_model=16, n_layers=4, n_heads=2, d_mlp=32,
                                                      d_vocab=model.cfg.d_vocab, mask_token_id=3))
    with pytest.raises(InputError):
        lens_trace(model, out, lens=TunedLens.identity(other))
