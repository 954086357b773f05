"""Held-out misuse, round six: memory_plan runs generate's own prompt/batch checks (a plan exists only for a run
generate accepts), names what is missing when no shape is given, range messages read as English, and a knockout
condition that cut nothing says so."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, validate
from mdm_lens.errors import ArgumentTypeError, OutOfRangeError, SamplerConfigError
from mdm_lens.probes.knockout import knockout
from tests.families.bd3gidd_checkpoints import write_bd3lm


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    folder, _ = write_bd3lm(tmp_path_factory.mktemp("bd3m6"), seed=1)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.mark.parametrize("shape", [dict(prompt=torch.full((1, 1), 7)), dict(prompt_length=1)])
def test_memory_plan_refuses_the_kv_cache_length_generate_refuses(bd3, shape):
    with pytest.raises(SamplerConfigError, match="multiple of block_size") as plan_err:
        bd3.memory_plan(**shape, gen_length=14, steps=4, kv_cache=True)
    with pytest.raises(SamplerConfigError) as gen_err:
        bd3.generate(torch.full((1, 1), 7), gen_length=14, steps=4, kv_cache=True)
    assert str(plan_err.value) == str(gen_err.value)
    assert bd3.memory_plan(**shape, gen_length=15, steps=4, kv_cache=True) is not None  # whole blocks: planned


def test_memory_plan_refuses_a_batch_first_hitting_cannot_take(bd3):
    with pytest.raises(SamplerConfigError, match="one row at a time"):
        bd3.memory_plan(prompt_length=1, batch=2, gen_length=15, steps=4)
    assert bd3.memory_plan(prompt_length=1, batch=2, gen_length=15, steps=4, first_hitting=False) is not None


def test_memory_plan_without_a_shape_names_prompt():
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    with pytest.raises(ArgumentTypeError, match="pass prompt") as err:
        model.memory_plan(gen_length=4, steps=4)
    assert err.value.argument == "prompt"


@pytest.mark.parametrize("what, article", [("answer position of 4", "an"), ("index", "an"), ("layer", "a"),
                                           ("step of this 4-step run", "a")])
def test_range_messages_take_the_right_article(what, article):
    with pytest.raises(OutOfRangeError) as err:
        validate.index(9, 4, name="x", what=what)
    assert f"expected {article} {what} in [-4, 3]" in str(err.value)


def test_a_condition_that_cut_nothing_says_so():
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    r = knockout(model, model.to_tokens("The capital is"), targets=[], gen_length=4, n_steps=4)
    notes = dict(zip(r.conditions, r.condition_notes))
    assert bool((r.n_targets == 0).all())
    assert notes["clean"] == "" and notes["targets"].startswith("nothing cut")
    cut = knockout(model, model.to_tokens("The capital is"), targets=[0, 1], gen_length=4, n_steps=4)
    assert not any("nothing cut" in n for n in cut.condition_notes)  # keys were cut: no such note


def _ddit_models(tmp_path):
    from tests.families.bd3gidd_checkpoints import write_gidd
    from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit

    load = lambda folder: HookedMDM.from_pretrained(str(folder), load_tokenizer=False)  # noqa: E731
    return dict(mdlm=load(write_ddit(tmp_path / "m", MDLM_CONFIG)[0]), duo=load(write_ddit(tmp_path / "d", DUO_CONFIG)[0]),
                bd3lm=load(write_bd3lm(tmp_path / "b")[0]), gidd=load(write_gidd(tmp_path / "g")[0]))


def test_settings_built_directly_are_checked_by_resolve(tmp_path):
    # resolve() is the settings' own check (as every sampler's resolve validates its fields), not only the
    # registry's table: a dataclass built by hand with an out-of-range value is refused naming the field
    from mdm_lens.diffusion.bd3lm import BD3LMSettings
    from mdm_lens.diffusion.ddit import DuoSettings, MDLMSettings
    from mdm_lens.diffusion.gidd import GiddSettings

    models = _ddit_models(tmp_path)
    cases = [(MDLMSettings(gen_length=4, steps=4, eps=1.5), "mdlm", "eps"),
             (DuoSettings(gen_length=4, steps=4, p_nucleus=0.0), "duo", "p_nucleus"),
             (BD3LMSettings(gen_length=4, steps=4, nucleus_p=1.5), "bd3lm", "nucleus_p"),
             (GiddSettings(gen_length=4, steps=4, min_p=1.0), "gidd", "min_p")]
    for settings, family, field in cases:
        with pytest.raises(SamplerConfigError) as err:
            settings.resolve(models[family])
        assert err.value.argument == field, (family, err.value)


def test_memory_plan_runs_each_samplers_own_input_checks(tmp_path):
    # one `check_inputs` per sampler, run by generate and memory_plan alike: a block sampler's one-row rule and the
    # block canvas beyond the context are refused by the plan with generate's own message
    from tests.families.family_checkpoints import write_llada2

    model = HookedMDM.from_pretrained(str(write_llada2(tmp_path / "l2")[0]), load_tokenizer=False)
    two = torch.randint(0, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    far = dict(gen_length=model.cfg.n_ctx, block_length=32, steps=4)
    for prompt, kw in ((two, dict(gen_length=32, block_length=32, steps=4)), (two[:1], far)):
        with pytest.raises(SamplerConfigError) as plan_err:
            model.memory_plan(prompt, sampler="llada2", **kw)
        with pytest.raises(SamplerConfigError) as gen_err:
            model.generate(prompt, sampler="llada2", **kw)
        assert str(plan_err.value) == str(gen_err.value)
    with pytest.raises(SamplerConfigError, match="one unpadded prompt"):
        model.memory_plan(prompt_length=8, batch=2, sampler="llada2", gen_length=32, block_length=32, steps=4)


def test_sdar_says_when_the_reference_quirk_rewrote_prompt_tokens():
    # a block the prompt partly fills, one step: the reference's topk count (the whole block) exceeds the masks left
    # and overwrites prompt tokens 4 and 5; reproduced, and said
    from mdm_lens.diffusion.arguments import ReferenceQuirkWarning

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    prompt = torch.tensor([[1, 10, 20, 30, 40, 50]])
    with pytest.warns(ReferenceQuirkWarning, match=r"2 of them prompt tokens \[4, 5\]"):
        out = model.generate(prompt, sampler="sdar", steps=1, gen_length=6, block_length=4, temperature=1, seed=0)
    assert not torch.equal(out.tokens[:, :6], prompt)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuirkWarning)  # a prompt ending at a block boundary: nothing rewritten
        model.generate(prompt[:, :4], sampler="sdar", steps=4, gen_length=8, block_length=4, temperature=1, seed=0)


def test_unknown_keywords_are_typed_errors_naming_the_nearest():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.lens.linear import item_split
    from mdm_lens.probes.absorption import absorption_by_layer

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    x = model.to_tokens("The capital is")
    with pytest.raises(ArgumentError, match="Did you mean attention_mask=") as err:
        model(x, atention_mask=torch.ones_like(x))
    assert err.value.argument == "atention_mask"
    with pytest.raises(ArgumentError, match="TransformerLens forward option"):
        model(x, stop_at_layer=2)
    with pytest.raises(ArgumentError, match="absorption_by_layer.. got an unknown keyword nan_policy"):
        absorption_by_layer(model, x, nan_policy="omit")
    with pytest.raises(ArgumentError, match="unknown keyword test_size=0.0. Accepted: n_items, test_fraction"):
        item_split(6, test_size=0.0)
    assert item_split(6, test_fraction=0.5) is not None  # known keywords pass through the check


def test_output_paths_of_the_wrong_kind_are_typed_errors(tmp_path):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading import save_pretrained
    from mdm_lens.views.sweep_report import report

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    out = model.generate(model.to_tokens("The capital is"), gen_length=4, steps=4)
    page = out.explore(model)
    with pytest.raises(ArgumentError, match="is a folder"):
        page.save(tmp_path)
    with pytest.raises(ArgumentError, match="does not exist"):
        page.save(tmp_path / "missing" / "page.html")
    assert page.save(tmp_path / "page.html").is_file()
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(ArgumentError, match="is a file, not a folder"):
        save_pretrained(model, a_file)
    with pytest.raises(ArgumentError, match="is a file, not a folder"):
        report(tmp_path, out=a_file)


def test_retrieval_items_that_are_plain_strings_are_refused_saying_what_an_item_is():
    from mdm_lens.errors import InputTypeError
    from mdm_lens.probes.retrieval import retrieval_scores

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    with pytest.raises(InputTypeError, match="QAItem") as err:
        retrieval_scores(model, ["the capital of x is y"])
    assert err.value.argument == "items"


def test_ddit_readout_names_the_residual_width(tmp_path):
    from mdm_lens.errors import InputError
    from tests.families.ddit_checkpoints import DUO_CONFIG, write_ddit

    duo = HookedMDM.from_pretrained(str(write_ddit(tmp_path / "d", DUO_CONFIG)[0]), load_tokenizer=False)
    with pytest.raises(InputError, match=f"d_model={duo.cfg.d_model}"):
        duo.readout(torch.randn(2, 5, duo.cfg.d_model - 1), sigma=0.5)
    assert duo.readout(torch.randn(2, 5, duo.cfg.d_model), sigma=0.5).shape == (2, 5, duo.cfg.d_vocab)


@pytest.mark.parametrize("family", ["nemotron", "llada2"])
def test_a_mask_id_that_is_the_eos_id_is_refused_at_load(tmp_path, family):
    from mdm_lens.errors import ConfigError
    from tests.families.family_checkpoints import MASK_ID, write_llada2
    from tests.families.nemotron_fixture import write_nemotron

    write = write_nemotron if family == "nemotron" else write_llada2
    folder = write(tmp_path / family, eos_token_id=MASK_ID)[0]
    with pytest.raises(ConfigError, match="mask_token_id=.* and eos_token_id=.* are the same token"):
        HookedMDM.from_pretrained(str(folder))


def test_an_explicit_device_beside_a_device_map_is_refused(tmp_path):
    from mdm_lens.errors import ArgumentError

    for kw in (dict(device="cpu", device_map="auto"), dict(device="cpu", device_map={"": "disk"},
                                                            offload_folder=str(tmp_path / "off"))):
        with pytest.raises(ArgumentError, match="were both given") as err:
            HookedMDM.from_pretrained("mdm-lens/tiny-mdm", **kw)
        assert err.value.argument == "device"
    assert HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="auto").hf_device_map == {"": "cpu"}


def test_a_step_bound_hook_in_a_pair_is_refused_outside_generate_as_the_named_form():
    from mdm_lens import at_steps
    from mdm_lens.errors import ArgumentError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    x = model.to_tokens("The capital is")
    zero = lambda a, hook: a * 0  # noqa: E731
    for hooks in ([("blocks.0.hook_resid_post", at_steps(zero, [1]))],
                  [at_steps(zero, [1], name="blocks.0.hook_resid_post")]):
        with pytest.raises(ArgumentError, match="a plain forward has no step"):
            model.run_with_hooks(x, fwd_hooks=hooks)
    every = model.run_with_hooks(x, fwd_hooks=[("blocks.0.hook_resid_post", at_steps(zero, None))])
    plain = model.run_with_hooks(x, fwd_hooks=[("blocks.0.hook_resid_post", zero)])
    assert torch.equal(every, plain)  # bound to every step: every forward
    out = model.generate(x, gen_length=4, steps=4)
    seen = []
    out.replay(model, 1, fwd_hooks=[("blocks.0.hook_resid_post", at_steps(lambda a, hook: seen.append(1), [1]))])
    assert seen == [1]  # inside a replay the step exists
