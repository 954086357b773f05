"""Round 25, DiffusionGemma: every sampler setting is checked by mdm_lens before compute (typed SamplerConfigError
naming the setting), transformers' validator never escapes raw, and probes refuse DiffusionGemma's spellings of
their own length arguments naming the argument to use instead."""

from __future__ import annotations

import pytest
import torch

from mdm_lens.errors import ArgumentError, SamplerConfigError

pytest.importorskip("transformers.models.diffusion_gemma")

from mdm_lens.bridge import TransformersBridge  # noqa: E402
from mdm_lens.bridge.tiny import tiny_diffusion_gemma  # noqa: E402

KW = dict(max_new_tokens=16, max_denoising_steps=4)


@pytest.fixture(scope="module")
def model():
    return TransformersBridge(tiny_diffusion_gemma(seed=0))


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(0))


def _refused(model, prompt, **extra):
    with pytest.raises(SamplerConfigError) as info:
        model.generate(prompt, **{**KW, **extra})
    return info.value


@pytest.mark.parametrize("name,value,allowed", [
    ("entropy_bound", float("nan"), "a finite number > 0"),      # S3: ran, changing the tokens
    ("t_min", float("nan"), "a finite number >= 0"),             # C1: raw RuntimeError from multinomial
    ("t_max", float("inf"), "a finite number >= 0"),
    ("confidence_threshold", float("nan"), "a finite number > 0"),
    ("stability_threshold", -1, "an int >= 0"),                  # C2: AttributeError from transformers
    ("eos_token_id", -5, "an int >= 0"),                         # S3: EOS stopping silently off
])
def test_out_of_range_settings_are_refused_naming_the_setting(model, prompt, name, value, allowed):
    e = _refused(model, prompt, **{name: value})
    assert e.argument == name and str(e).startswith(f"{name}={value!r} is invalid") and allowed in str(e)


@pytest.mark.parametrize("name,value", [("eos_token_id", 99999), ("eos_token_id", [1, 128]), ("pad_token_id", 200),
                                        ("bos_token_id", 128)])
def test_token_ids_outside_the_vocabulary_are_refused(model, prompt, name, value):
    e = _refused(model, prompt, **{name: value})
    assert e.argument == name and e.value == value
    assert f"{name}={value!r} is invalid: token ids must be in [0, 128)" in str(e)


@pytest.mark.parametrize("name,value", [("confidence_threshold", "0.5"), ("stability_threshold", 2.5),
                                        ("max_denoising_steps", None), ("max_new_tokens", 8.0)])
def test_wrong_types_are_sampler_config_errors_naming_the_setting(model, prompt, name, value):
    e = _refused(model, prompt, **{name: value})
    assert isinstance(e, TypeError) and e.argument == name and e.value == value


def test_t_max_must_exceed_t_min(model, prompt):
    e = _refused(model, prompt, t_min=0.9, t_max=0.5)
    assert e.argument == "t_max" and e.value == 0.5 and "t_max must exceed t_min" in str(e)


def test_a_generation_config_value_transformers_cannot_report_is_named(model, prompt):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    gc = DiffusionGemmaGenerationConfig(max_denoising_steps=4)
    gc.stability_threshold = -1  # set after construction: transformers' validator would raise an AttributeError
    with pytest.raises(SamplerConfigError) as info:
        model.generate(prompt, max_new_tokens=16, generation_config=gc)
    assert info.value.argument == "stability_threshold" and "(from generation_config=)" in str(info.value)
    gc = DiffusionGemmaGenerationConfig(max_denoising_steps=4, eos_token_id=500)
    with pytest.raises(SamplerConfigError, match=r"eos_token_id=500 is invalid: token ids must be in \[0, 128\)"):
        model.generate(prompt, max_new_tokens=16, generation_config=gc)


def test_what_transformers_accepts_still_runs_unchanged(model, prompt):
    # an int confidence_threshold (transformers' validator raised an AttributeError on it) runs as its float
    a = model.generate(prompt, **KW, confidence_threshold=1)
    b = model.generate(prompt, **KW, confidence_threshold=1.0)
    assert torch.equal(a.tokens, b.tokens)
    # t_max=None turns the schedule off, as in transformers (the recorded temperature no longer crashes)
    model.generate(prompt, **KW, t_min=0.4, t_max=None)
    model.generate(prompt, **KW, eos_token_id=[1, 127], pad_token_id=0)


@pytest.mark.parametrize("given,argument,instead", [
    (dict(max_new_tokens=8, max_denoising_steps=2), "max_new_tokens", "gen_length="),
    (dict(gen_length=8, max_denoising_steps=2), "max_denoising_steps", "n_steps="),
])
def test_knockout_names_its_own_length_arguments(model, prompt, given, argument, instead):
    from mdm_lens.probes import patching as PT

    with pytest.raises(ArgumentError) as info:
        PT.knockout(model, prompt, steps=[0], layers=[1], **given)
    assert info.value.argument == argument and f"knockout({argument}=...)" in str(info.value)
    assert instead in str(info.value) and "not both" not in str(info.value)
    PT.knockout(model, prompt, steps=[0], layers=[1], gen_length=8, n_steps=2)  # its own names run

