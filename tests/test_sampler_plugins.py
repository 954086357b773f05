"""Samplers as plug-ins (`mdm_lens.diffusion.registry`): a new sampler is one module with a settings dataclass
and a `register(...)` call; `generate` validates against that sampler's settings, shows them on `out.settings`,
refuses what the sampler would ignore, and plans steps/blocks/phases before compute."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, SamplerConfigError
from mdm_lens import steps as steps_
from mdm_lens.diffusion import DEFAULT, generate, plan, registry, rules
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan, masked_canvas
from mdm_lens.diffusion.dream import DreamSettings
from mdm_lens.diffusion.llada import LLaDASettings
from mdm_lens.diffusion.arm import ARMSettings
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import ArgumentError

MASK = 19
PROMPT = torch.tensor([[3, 4, 5, 6]])


def tiny(kind: str = "llada") -> HookedMDM:
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                    attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream",
                    n_ctx=24, eos_token_id=1)
    return HookedMDM.from_config(cfg, seed=0, init_std=0.3)


@dataclass
class OrderSettings(CanvasSettings):
    order: str = "left"  # commit the leftmost / rightmost masked position each step

    def resolve(self, model):
        from mdm_lens import validate

        n = self.lengths(model)
        if n["steps"] != n["gen_length"]:
            raise SamplerConfigError("one token per step", argument="steps", value=n["steps"])
        return dataclasses.replace(self, **n, order=validate.choice(self.order, ("left", "right"), name="order",
                                                                    error=SamplerConfigError))


# every caller-settable field declares its rule (mdm_lens.diffusion.rules); the registry refuses a sampler without
OrderSettings.rules = {**CanvasSettings.rules, "order": rules.choice(("left", "right"))}


class OrderSampler(CanvasSampler):
    """A toy sampler written as a user would: greedy tokens, a fixed commit order."""

    name, Settings = "toy_order", OrderSettings

    def run(self, runner, ids, am, model, s, generator, bar):
        x, am = masked_canvas(ids, am, s.gen_length, model.cfg.mask_token_id)
        batch, total = x.shape
        recorder = TrajectoryRecorder(batch, total, ids.shape[1], x.device)
        for step in range(s.steps):
            masked = x == MASK
            state = DenoisingState(step, s.steps, 0, 1, x.clone(), masked, ~masked, am.bool())
            logits = runner.forward(state, x, attention_mask=am)
            pos = masked.int().argmax(-1) if s.order == "left" else total - 1 - masked.flip(-1).int().argmax(-1)
            committed = torch.zeros_like(masked)
            committed[torch.arange(batch), pos] = True
            x_in = state.x
            x = torch.where(committed, logits.argmax(-1), x)
            state.committed, state.confidence = committed, torch.where(committed, 1.0, float("-inf"))
            runner.end_step(state)
            recorder.record(step, 0, x_in, committed, state.confidence)
        return x, am, recorder


@pytest.fixture
def toy():
    sampler = registry.register(OrderSampler())
    try:
        yield sampler
    finally:
        registry._REGISTRY.pop(sampler.name)


def test_a_new_sampler_needs_no_shared_signature(toy):
    model = tiny()
    left = generate(model, PROMPT, sampler="toy_order", gen_length=3, seed=0)
    right = model.generate(PROMPT, sampler="toy_order", gen_length=3, order="right")
    assert left.sampler == "toy_order" and left.settings == dict(steps=3, gen_length=3, order="left", seed=0,
                                                                 mask_id=MASK)
    assert right.trajectory.commit_step[0, 4:].tolist() == [2, 1, 0]
    assert left.trajectory.commit_step[0, 4:].tolist() == [0, 1, 2]
    assert plan(model, sampler="toy_order", gen_length=3) == Plan(3, 1, ("cond",))
    with pytest.raises(SamplerConfigError, match="order='middle' is invalid"):
        model.generate(PROMPT, sampler="toy_order", gen_length=3, order="middle")
    with pytest.raises(SamplerConfigError, match=r"unknown setting cfg_scale=0.5 for sampler 'toy_order': it is a "
                                                 r"setting of sampler 'llada'"):
        model.generate(PROMPT, sampler="toy_order", gen_length=3, cfg_scale=0.5)
    model.generate(PROMPT, sampler="toy_order", gen_length=3, cfg_scale=0.0)  # LLaDA's do-nothing value
    with pytest.raises(SamplerConfigError, match="order"):  # its own option is refused by the other samplers
        model.generate(PROMPT, sampler="llada", gen_length=3, order="left")


def test_generate_has_no_sampler_specific_parameters():
    params = set(inspect.signature(generate).parameters)
    assert params == {"model", "prompt", "sampler", "attention_mask", "fwd_hooks", "hook_steps", "record", "cache",
                      "seed", "progress", "settings"}
    assert {"llada", "dream", "arm", "diffusion_gemma"} <= set(registry.names())


@pytest.mark.parametrize("cls, defaults", [
    (LLaDASettings, dict(steps=None, gen_length=None, block_length=None, temperature=0.0, cfg_scale=0.0,
                         remasking="low_confidence", logits_eos_inf=False, confidence_eos_eot_inf=False,
                         threshold=None, factor=None, sampler_rule="llada", gamma=None, kv_cache=None)),
    (DreamSettings, dict(steps=None, gen_length=None, temperature=1.0, top_p=1.0, top_k=50, alg=DEFAULT,
                         alg_temp=None, eps=1e-3, kv_cache=None, block_length=None, threshold=None, factor=None)),
    (ARMSettings, dict(steps=None, gen_length=None, temperature=0.0, top_p=None, top_k=None, stop_at_eos=False)),
])
def test_settings_dataclasses_hold_the_reference_defaults(cls, defaults):
    fields = {f.name: f.default for f in dataclasses.fields(cls) if not f.metadata.get("resolved")}
    assert fields == defaults


def test_another_samplers_option_is_accepted_only_at_its_do_nothing_value():
    dream = tiny("dream")
    out = dream.generate(PROMPT, gen_length=4, cfg_scale=0.0, block_length=4, stop_at_eos=False, temperature=0)
    assert "cfg_scale" not in out.settings and out.settings["temperature"] == 0.0
    # another sampler's *default* that selects its algorithm is not a do-nothing value
    for bad in (dict(cfg_scale=0.5), dict(block_length=2), dict(remasking="random"), dict(stop_at_eos=True),
                dict(remasking="low_confidence")):
        with pytest.raises(SamplerConfigError) as info:
            dream.generate(PROMPT, gen_length=4, **bad)
        assert info.value.argument == next(iter(bad))
    llada = tiny("llada")
    llada.generate(PROMPT, gen_length=4, top_k=None, top_p=None, alg_temp=None)
    for bad in (dict(top_k=3), dict(top_p=0.5), dict(alg="entropy"), dict(eps=0.1), dict(alg="origin"),
                dict(eps=1e-3)):
        with pytest.raises(SamplerConfigError) as info:
            llada.generate(PROMPT, gen_length=4, **bad)
        assert info.value.argument == next(iter(bad)) and "'llada'" in str(info.value)
    with pytest.raises(SamplerConfigError, match="unknown setting gen_lenght=4 for sampler 'llada'"):
        llada.generate(PROMPT, gen_lenght=4)


def test_plan_is_the_runs_own_resolution():
    llada, arm = tiny("llada"), tiny("arm")
    assert plan(llada, gen_length=8, block_length=4, steps=6, cfg_scale=1.0) == Plan(6, 2, ("cond", "uncond"))
    assert plan(llada, gen_length=8, fwd_hooks=[], seed=3) == Plan(8, 1, ("cond",))
    out = llada.generate(PROMPT, gen_length=8, block_length=4, steps=6, cfg_scale=1.0)
    assert out.trajectory.n_steps == 6 and out.trajectory.block_of_step.tolist() == [0, 0, 0, 1, 1, 1]
    assert plan(arm, gen_length=5) == Plan(5, 1, ("cond",))
    with pytest.raises(SamplerConfigError, match="divisible by the number of blocks"):
        plan(llada, gen_length=8, block_length=4, steps=5)
    with pytest.raises(ArgumentError, match="sampler"):
        plan(llada, sampler="nope")


def test_registering_needs_a_settings_dataclass():
    class Bad(registry.Sampler):
        name, Settings = "bad", dict

    with pytest.raises(TypeError, match="SamplerSettings dataclass"):
        registry.register(Bad())
    assert "bad" not in registry.names()


def test_runs_of_unknown_length_refuse_steps_counted_from_the_end():
    """ARM with stop_at_eos stops when every row has emitted EOS: 'last' of the budget may never run."""
    arm = tiny("arm")
    assert plan(arm, gen_length=4, stop_at_eos=True).adaptive and plan(arm, gen_length=4).adaptive is None
    with pytest.raises(SamplerConfigError, match="counted from the end"):
        arm.generate(PROMPT, gen_length=4, stop_at_eos=True, cache="hook_embed" @ steps_("last"))
    assert arm.generate(PROMPT, gen_length=4, cache="hook_embed" @ steps_("last")).cache.steps == [3]
