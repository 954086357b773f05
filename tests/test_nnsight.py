"""`mdm_lens.nnsight`: `tracer.iter[k]` is denoising step k, and what nnsight saves or changes at a step is
exactly what mdm_lens' own step hooks save or change there."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("nnsight")

from mdm_lens import (ArgumentTypeError, GenerateOutput, HookedMDM, InputError, MDMConfig,  # noqa: E402
                      OutOfRangeError, at_steps, steps)
from mdm_lens.nnsight import DiffusionLM, StepNotRunError  # noqa: E402

MASK = 49
PROMPT = torch.randint(2, 40, (2, 5), generator=torch.Generator().manual_seed(0))
PADDED = PROMPT.clone()
PADDED[1, :2] = 0  # row 1 is left-padded: 3 real tokens
PAD_MASK = torch.ones_like(PADDED)
PAD_MASK[1, :2] = 0


def model_for(kind: str = "llada", seed: int = 1) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream",
                    n_ctx=64, eos_token_id=1)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3)


@pytest.fixture(scope="module")
def llada():
    model = model_for()
    return model, DiffusionLM(model)


# --- what is saved at step k is the step cache at k ------------------------------------------------

@pytest.mark.parametrize("kind", ["llada", "dream", "arm"])
def test_saved_values_equal_the_step_cache(kind):
    model = model_for(kind)
    lm = DiffusionLM(model)
    chosen = [0, 3, 5]
    names = ["blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post"]
    kw = dict(steps=8, gen_length=8, **({"block_length": 4} if kind == "llada" else {}))
    pats, resid = [], []
    with lm.generate(PROMPT, **kw) as tracer:
        for _ in tracer.iter[chosen]:
            pats.append(lm.blocks[0].attn.hook_pattern.output.save())
            resid.append(lm.blocks[1].hook_resid_post.output.save())
    ref = model.generate(PROMPT, cache=names @ steps(*chosen), **kw)
    assert ref.cache.steps == chosen
    for i, step in enumerate(chosen):
        assert torch.equal(pats[i], ref.cache[step]["blocks.0.attn.hook_pattern"])
        assert torch.equal(resid[i], ref.cache[step]["blocks.1.hook_resid_post"])
    assert not torch.equal(resid[0], resid[1])  # different steps, different values


def test_negative_steps_and_all_steps(llada):
    model, lm = llada
    every = []
    with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
        for step in tracer.all():
            every.append(lm.blocks[0].hook_resid_pre.output.save())
        for _ in tracer.iter[-1]:  # requests follow the run: step 7's layer 1 comes after its layer 0
            last = lm.blocks[1].attn.hook_pattern.output.save()
    ref = model.generate(PROMPT, steps=8, gen_length=8,
                         cache=["blocks.1.attn.hook_pattern", "blocks.0.hook_resid_pre"] @ steps())
    assert torch.equal(last, ref.cache[7]["blocks.1.attn.hook_pattern"])
    assert len(every) == 8
    for step in range(8):
        assert torch.equal(every[step], ref.cache[step]["blocks.0.hook_resid_pre"])


def test_sampler_state_per_step(llada):
    model, lm = llada
    seen = {k: [] for k in ("canvas", "masked", "block", "confidence", "committed", "state")}
    with lm.generate(PROMPT, steps=8, gen_length=8, block_length=4) as tracer:
        for _ in tracer.all():
            for name in seen:
                seen[name].append(getattr(lm.sampler, name).save())
        out = lm.generator.output.save()
    tr = out.trajectory
    for k in range(8):
        assert torch.equal(seen["canvas"][k], tr.x_steps[k])
        assert torch.equal(seen["masked"][k], tr.x_steps[k] == MASK)
        assert seen["block"][k] == int(tr.block_of_step[k]) == k // 4
        assert torch.equal(seen["committed"][k], tr.commit_step == k)
        chosen = tr.commit_step == k
        assert torch.equal(seen["confidence"][k][chosen], tr.commit_confidence[chosen])
        assert seen["state"][k].step == k and seen["state"][k].committed is seen["committed"][k]


def test_generator_output_is_the_generate_output(llada):
    model, lm = llada
    with lm.generate(PROMPT, steps=4, gen_length=8, block_length=4) as tracer:
        out = lm.generator.output.save()
        result = tracer.result.save()
    ref = model.generate(PROMPT, steps=4, gen_length=8, block_length=4)
    assert isinstance(out, GenerateOutput) and result is out
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.trajectory.commit_step, ref.trajectory.commit_step)
    direct = lm.generate(PROMPT, steps=4, gen_length=8, block_length=4)  # no `with`: just runs
    assert torch.equal(direct.tokens, ref.tokens)


# --- an intervention at step k is the at_steps hook at k -------------------------------------------

def _flip(x, hook=None):
    x[:, 5:] *= -1
    return x


@pytest.mark.parametrize("cfg_scale,block_length,padded", [(0.0, 8, False), (1.5, 4, False), (0.0, 4, True),
                                                           (1.5, 8, True)])
def test_intervention_matches_the_at_steps_hook(llada, cfg_scale, block_length, padded):
    model, lm = llada
    prompt, am = (PADDED, PAD_MASK) if padded else (PROMPT, None)
    kw = dict(steps=8, gen_length=8, block_length=block_length, cfg_scale=cfg_scale, attention_mask=am)
    try:
        plain = model.generate(prompt, **kw)
    except InputError as e:  # main's CFG pass masked the pads too; the sampler fix (issue 11) keeps them
        if "padding uses the mask token" in str(e):
            pytest.skip("CFG with a left-padded batch needs the sampler's pad-keeping unconditional pass")
        raise
    with lm.generate(prompt, **kw) as tracer:
        for _ in tracer.iter[2]:
            lm.blocks[1].hook_resid_post.output[:, 5:] *= -1
        out = lm.generator.output.save()
    ref = model.generate(prompt, fwd_hooks=[at_steps(_flip, [2], name="blocks.1.hook_resid_post")], **kw)
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.trajectory.commit_step, ref.trajectory.commit_step)
    assert torch.equal(out.trajectory.commit_confidence.nan_to_num(), ref.trajectory.commit_confidence.nan_to_num())
    assert not torch.equal(ref.trajectory.commit_confidence.nan_to_num(),
                           plain.trajectory.commit_confidence.nan_to_num())  # the edit did change the run


@pytest.mark.parametrize("kind", ["dream", "arm"])
def test_intervention_matches_the_at_steps_hook_other_samplers(kind):
    model = model_for(kind)
    lm = DiffusionLM(model)
    kw = dict(steps=6, gen_length=6, attention_mask=PAD_MASK, temperature=0.0)
    with lm.generate(PADDED, **kw) as tracer:
        for _ in tracer.iter[1]:
            lm.blocks[1].hook_resid_post.output[:, 5:] *= -1
        out = lm.generator.output.save()
    ref = model.generate(PADDED, fwd_hooks=[at_steps(_flip, [1], name="blocks.1.hook_resid_post")], **kw)
    plain = model.generate(PADDED, **kw)
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.trajectory.commit_step, ref.trajectory.commit_step)
    assert not torch.equal(ref.tokens, plain.tokens)


def test_unconditional_phase_is_reached_explicitly(llada):
    model, lm = llada
    kw = dict(steps=4, gen_length=8, block_length=4, cfg_scale=2.0)
    with lm.generate(PROMPT, **kw) as tracer:
        for _ in tracer.iter[1]:
            cond = lm.blocks[0].hook_resid_pre.output.save()
            uncond = lm.blocks[0].hook_resid_pre.phase("uncond").output.save()
            lm.blocks[1].hook_resid_post.phase("uncond").output[:, 5:] *= -1
        out = lm.generator.output.save()
    ref = model.generate(PROMPT, cache="blocks.0.hook_resid_pre" @ steps(1, phases=("cond", "uncond")), **kw)
    # the cache keeps the cond pass of each step; the uncond pass is the prompt-masked input
    assert torch.equal(cond, ref.cache[1]["blocks.0.hook_resid_pre"])
    masked_input = out.trajectory.x_steps[1].masked_fill(torch.arange(13) < 5, MASK)
    assert torch.equal(uncond, model.W_E[masked_input])
    hooked = model.generate(PROMPT, fwd_hooks=[at_steps(_flip, steps(1, phases=("uncond",)),
                                                        name="blocks.1.hook_resid_post")], **kw)
    assert torch.equal(out.tokens, hooked.tokens)
    assert torch.equal(out.trajectory.commit_step, hooked.trajectory.commit_step)


def test_explicit_attention_only_at_the_traced_steps(llada, monkeypatch):
    model, lm = llada
    attn = model.blocks[0].attn
    explicit_steps = []
    original = attn._explicit

    def counted(*args, **kwargs):
        explicit_steps.append((model.state.step, model.state.phase))
        return original(*args, **kwargs)

    monkeypatch.setattr(attn, "_explicit", counted)
    with lm.generate(PROMPT, steps=8, gen_length=8, cfg_scale=1.0) as tracer:
        for _ in tracer.iter[2]:
            lm.blocks[0].attn.hook_pattern.output.save()
        for _ in tracer.iter[4]:
            lm.blocks[0].attn.hook_attn_scores.phase("uncond").output.save()
        for _ in tracer.iter[6]:
            lm.blocks[0].attn.hook_pattern.output.save()
    assert explicit_steps == [(2, "cond"), (4, "uncond"), (6, "cond")]


# --- a plain forward -------------------------------------------------------------------------------

def test_plain_trace_is_a_forward(llada):
    model, lm = llada
    tokens = PADDED
    with lm.trace(tokens, attention_mask=PAD_MASK):
        lm.blocks[0].hook_resid_post.output[:, 2] = 0
        logits = lm.output.save()

    def zero(x, hook):
        x[:, 2] = 0
        return x

    ref = model.run_with_hooks(tokens, attention_mask=PAD_MASK, fwd_hooks=[("blocks.0.hook_resid_post", zero)])
    _, cache = model.run_with_cache(tokens, attention_mask=PAD_MASK, names_filter="blocks.1.attn.hook_pattern")
    assert torch.equal(logits, ref)
    assert not torch.allclose(logits, model(tokens, attention_mask=PAD_MASK))
    with lm.trace(tokens, attention_mask=PAD_MASK):
        pattern = lm.blocks[1].attn.hook_pattern.output.save()
    assert torch.equal(pattern, cache["pattern", 1])


# --- errors ----------------------------------------------------------------------------------------

def test_step_past_the_end_names_the_number_of_steps(llada):
    _, lm = llada
    for key in (8, -9, slice(0, 9), [3, 8]):
        with pytest.raises(OutOfRangeError, match="8"):
            with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
                for _ in tracer.iter[key]:
                    lm.blocks[0].output.save()
    with pytest.raises(OutOfRangeError, match="selects no step"):
        with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
            for _ in tracer.iter[5:5]:
                lm.blocks[0].output.save()


def test_value_from_a_step_that_never_ran(llada):
    _, lm = llada
    # layer 0 asked for after step 7's layer 1: an out-of-order read of step 7 (not step 8's value)
    with pytest.raises(StepNotRunError, match=r"step 7 .*gone past it .*8 denoising steps"):
        with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
            for _ in tracer.iter[7]:
                lm.blocks[1].output.save()
                lm.blocks[0].output.save()
    with pytest.raises(StepNotRunError, match="step 7 .*gone past it"):  # the deprecated `with` form is no quieter
        with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with tracer.iter[7]:
                    lm.blocks[1].output.save()
                    lm.blocks[0].output.save()
    with pytest.raises(InputError, match="no unconditional pass"):
        with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
            lm.blocks[0].phase("uncond").output.save()


def test_a_run_that_stops_early():
    model = model_for("arm")
    model.cfg.eos_token_id = 0
    model.ln_final.w.data.zero_()  # every logit 0: greedy picks token 0, the EOS, at the first step
    lm = DiffusionLM(model)
    with pytest.raises(StepNotRunError, match=r"step 3 .* 1 denoising steps \(0\.\.0\) of the 4 planned"):
        with lm.generate(PROMPT, steps=4, gen_length=4, stop_at_eos=True) as tracer:
            for _ in tracer.iter[3]:
                lm.blocks[0].output.save()
    seen = []
    with pytest.warns(UserWarning, match="never reached"):  # an open loop ends with the run, as in nnsight
        with lm.generate(PROMPT, steps=4, gen_length=4, stop_at_eos=True) as tracer:
            for _ in tracer.all():
                seen.append(lm.sampler.committed.save())
    assert len(seen) == 1 and seen[0][:, 5].all()


def test_misuse_is_refused(llada):
    model, lm = llada
    with pytest.raises(InputError, match="read-only"):
        with lm.generate(PROMPT, steps=4, gen_length=4):
            lm.sampler.committed = torch.zeros(2, 9, dtype=torch.bool)
    with pytest.raises(InputError, match="one input per trace"):
        with lm.generate(steps=4, gen_length=4) as tracer:
            with tracer.invoke(PROMPT[:1]):
                lm.blocks[0].output.save()
            with tracer.invoke(PROMPT[1:]):
                lm.blocks[0].output.save()
    with pytest.raises(ArgumentTypeError, match="HookedMDM"):
        DiffusionLM(torch.nn.Linear(2, 2))
    with pytest.raises(InputError, match="phase"):
        lm.blocks[0].phase("encoder")
    # hooks and the model are left as they were
    assert not model.blocks[0].attn.needs_explicit() and model.state is None


def test_the_module_name_does_not_shadow_the_package(tmp_path):
    import mdm_lens
    import nnsight
    import subprocess
    import sys
    from pathlib import Path

    assert mdm_lens.nnsight.NNsight is nnsight.NNsight and Path(nnsight.__file__).parent.name == "nnsight"
    root = Path(mdm_lens.__file__).resolve().parent.parent
    # a script run from inside the package folder puts mdm_lens/ first on sys.path
    code = "import nnsight, mdm_lens.nnsight as ours; assert nnsight.NNsight is ours.NNsight; print(nnsight.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root / "mdm_lens", env={"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.name == "nnsight"


def test_an_out_of_order_read_inside_a_step_raises(llada):
    _, lm = llada
    # layer 0 already ran in step 2 when it is asked for: nnsight would serve step 3's value
    for form in ("for", "list"):
        with pytest.raises(StepNotRunError, match=r"blocks\.0\.output' at denoising step 2 .*gone past it"):
            with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:
                for _ in (tracer.iter[2] if form == "for" else tracer.iter[[2, 4]]):
                    lm.blocks[1].output.save()
                    lm.blocks[0].output.save()
    model, _ = llada
    ref = model.generate(PROMPT, steps=8, gen_length=8, cache=["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"])
    got = []
    with lm.generate(PROMPT, steps=8, gen_length=8) as tracer:  # in order, the step's own values
        for _ in tracer.iter[2:4]:
            got.append((lm.blocks[0].hook_resid_post.output.save(), lm.blocks[1].hook_resid_post.output.save()))
    for (a, b), step in zip(got, (2, 3)):
        assert torch.equal(a, ref.cache[step]["blocks.0.hook_resid_post"])
        assert torch.equal(b, ref.cache[step]["blocks.1.hook_resid_post"])


@pytest.mark.parametrize("name", ["canvas", "masked", "prompt", "confidence", "committed"])
def test_every_write_to_the_sampler_envoy_raises(llada, name):
    model, lm = llada
    clean = model.generate(PROMPT, steps=4, gen_length=4)
    with pytest.raises(InputError, match=f"lm.sampler.{name} is read-only"):
        with lm.generate(PROMPT, steps=4, gen_length=4) as tracer:
            for _ in tracer.iter[1]:
                getattr(lm.sampler, name)[:] = 0
    with pytest.raises(InputError, match="read-only"):
        with lm.generate(PROMPT, steps=4, gen_length=4) as tracer:
            for _ in tracer.iter[1]:
                setattr(lm.sampler.state, "x" if name == "canvas" else name, None)
    with pytest.raises(InputError, match="read-only"):
        with lm.generate(PROMPT, steps=4, gen_length=4) as tracer:
            for _ in tracer.iter[1]:
                lm.sampler.state.masked[:] = False
    # reads still see the run's values, and the run is the clean one
    with lm.generate(PROMPT, steps=4, gen_length=4) as tracer:
        for _ in tracer.iter[1]:
            seen = getattr(lm.sampler, name).save()
        out = lm.generator.output.save()
    assert torch.equal(out.tokens, clean.tokens)
    if name == "canvas":
        assert torch.equal(seen, clean.trajectory.x_steps[1])
