"""Every registered sampler declares a rule for every setting, and the registry applies it the same way: an
out-of-range value is refused, an option set away from its default while inactive is refused naming the option
that activates it, and the same option is accepted once active. Table-driven over the registry."""

from __future__ import annotations

import dataclasses

import pytest

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.diffusion import registry, rules
from mdm_lens.errors import ArgumentError, ArgumentTypeError, SamplerConfigError
from mdm_lens.hooks.steps import as_steps

SAMPLERS = [registry.get(n) for n in registry.names()]
FIELDS = [(s, f.name) for s in SAMPLERS for f in dataclasses.fields(s.Settings) if f.name in registry.settings_names(s)]
BAD = [(s, name, bad) for s, name in FIELDS for bad in s.Settings.rules[name].bad]
ACTIVE = [(s, name) for s, name in FIELDS if s.Settings.rules[name].active is not None]


def _good(rule: rules.Rule, default):
    """A valid value other than the default (for the inactive/active checks)."""
    for v in (0.5, 2, 0.25, 3, True):
        try:
            rule.check(v, "x")
        except ArgumentError:
            continue
        if v != default and type(v) is not bool or (type(default) is bool and v != default):
            return v
    raise AssertionError(rule)


def _settings(sampler, given):
    s = sampler.Settings(**given)
    rules.check_given(sampler.name, s, given)
    return s


def test_every_setting_of_every_sampler_has_a_rule():
    names = set(registry.names())
    assert {"arm", "llada", "dream", "llada2", "sdar", "fastdllm_v2", "diffusion_gemma", "mdlm", "duo", "nemotron",
            "nemotron_ar", "rnd1", "coda", "dreamon", "indel", "bd3lm", "gidd"} <= names, names
    assert len(FIELDS) > 80
    assert {s.name: rules.undeclared(s.Settings) for s in SAMPLERS} == {s.name: [] for s in SAMPLERS}


@pytest.mark.parametrize("sampler,name,bad", BAD, ids=[f"{s.name}.{n}={b!r}" for s, n, b in BAD])
def test_out_of_range_values_are_refused_naming_the_setting(sampler, name, bad):
    with pytest.raises(ArgumentError) as info:
        _settings(sampler, {name: bad})
    assert info.value.argument == name and name in str(info.value)


@pytest.mark.parametrize("sampler,name", ACTIVE, ids=[f"{s.name}.{n}" for s, n in ACTIVE])
def test_an_inactive_option_is_refused_and_accepted_once_active(sampler, name):
    rule = sampler.Settings.rules[name]
    default = {f.name: f.default for f in dataclasses.fields(sampler.Settings)}[name]
    value = _good(rule, default)
    with pytest.raises(SamplerConfigError, match=f"{name}=.*no effect.*unless") as info:
        _settings(sampler, {**rule.off, name: value})
    assert info.value.argument == name
    assert rule.when.split("=")[0].split(" ")[0] in str(info.value)  # names the option that activates it
    assert _settings(sampler, {**rule.on, name: value}).__getattribute__(name) == value
    _settings(sampler, {**rule.off, name: default})  # the default is never refused


@pytest.mark.parametrize("sampler,option,off", [
    ("fastdllm_v2", "factor_value", {}), ("sdar", "eb_threshold", {}),
    ("sdar", "confidence_threshold", {"remasking_strategy": "low_confidence_static"}),
    ("llada2", "num_to_transfer", {}), ("llada2", "max_post_steps", {}), ("llada", "gamma", {}),
    ("fastdllm_v2", "threshold", {"factor": True})])
def test_the_issue_cases_of_inert_options(sampler, option, off):
    with pytest.raises(SamplerConfigError, match="no effect"):
        _settings(registry.get(sampler), {**off, option: 2 if option in ("num_to_transfer", "max_post_steps") else 0.5})


@pytest.mark.parametrize("sampler", ["llada", "llada2", "fastdllm_v2", "dream"])
def test_threshold_is_a_probability_on_every_sampler(sampler):
    with pytest.raises(SamplerConfigError, match=r"threshold=1.5 is invalid"):
        _settings(registry.get(sampler), {"threshold": 1.5})
    assert _settings(registry.get(sampler), {"threshold": 1.0}).threshold == 1.0


def _tiny(family: str) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=1, n_heads=2, d_mlp=48, d_vocab=16, n_ctx=64, family=family,
                    mask_token_id=15, eos_token_id=2, pad_token_id=0, extra={"block_length": 4})
    return HookedMDM.from_config(cfg, seed=0, init_std=0.05, init="realistic")


def test_resolved_fields_are_refused_as_keywords_with_the_reason():
    model = _tiny("llada2_moe")
    with pytest.raises(SamplerConfigError, match=r"eos_id=5: sampler 'llada2' reads eos_id from the checkpoint"):
        registry.get("llada2").settings(model, {"eos_id": 5})
    # the effective value is still shown: what the run used
    assert registry.get("llada2").settings(model, {"gen_length": 8}).eos_id == 2


def test_register_refuses_a_taken_name_and_a_non_sampler():
    llada = registry.get("llada")
    clone = type(llada)()
    with pytest.raises(SamplerConfigError, match="'llada' is already registered.*replace=True"):
        registry.register(clone)
    assert registry.get("llada") is llada
    try:
        assert registry.register(clone, replace=True) is clone and registry.get("llada") is clone
    finally:
        registry.register(llada, replace=True)
    with pytest.raises(ArgumentTypeError, match="expected a Sampler instance"):
        registry.register(object())


def test_a_sampler_with_an_undeclared_setting_is_refused():
    @dataclasses.dataclass
    class Loose(registry.SamplerSettings):
        knob: int = 1

    class LooseSampler(registry.Sampler):
        name, Settings = "loose", Loose

    with pytest.raises(SamplerConfigError, match=r"declares no rule for \['knob'\]"):
        registry.register(LooseSampler())
    assert "loose" not in registry.names()


def test_empty_hook_steps_select_no_step_and_are_refused():
    for empty in ([], (), range(0)):
        with pytest.raises(SamplerConfigError, match="selects no step"):
            as_steps(empty)
    assert as_steps(None).resolve(4) is None  # None: every step
    assert as_steps([0, -1]).resolve(4) == {0, 3}
