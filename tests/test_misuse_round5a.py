"""Round 5a of misuse checks (issue #32, held-out findings of round five: S2, S3, C1, C2, C3 and the DDiT
UNCLEAR items). Each test pins a class of input that used to pass silently or fail with a raw error: the class test
runs every registered sampler on a model of every family and requires it to run or to be refused with a
SamplerConfigError before any forward."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.diffusion import MaskedAnswerWarning, registry
from mdm_lens.diffusion.family_check import DDIT_FAMILIES, PLAIN_CANVAS
from mdm_lens.errors import ArgumentError, InputError, OutOfRangeError, SamplerConfigError

sys.path.insert(0, str(Path(__file__).parent / "families"))
sys.path.insert(0, str(Path(__file__).parent))
from bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm, write_gidd  # noqa: E402
from ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit  # noqa: E402
from loss_family_models import family_model  # noqa: E402
from nemotron_fixture import write_nemotron  # noqa: E402
from rnd1_coda_checkpoints import write_coda, write_rnd1  # noqa: E402

PROMPT = torch.tensor([[10, 11, 12, 13]])  # no family's mask id (tiny-mdm: 3)
FAMILIES = ("llada", "dream", "llada2", "sdar", "fastdllm_v2", "rnd1", "coda", "nemotron", "tiny-mdm", "tiny-arm",
            "mdlm", "mdlm_tc", "duo", "bd3lm", "bd3lm_tc", "gidd")
# a run each sampler can finish on its own family's tiny model (other samplers' keywords are refused, also fine)
SETTINGS = dict(arm=dict(gen_length=4), fastdllm_v2=dict(max_new_tokens=8), nemotron=dict(gen_length=8),
                nemotron_ar=dict(gen_length=4), dreamon=dict(steps=2), indel=dict(gen_length=8), diffusion_gemma={},
                bd3lm=dict(gen_length=8, steps=8))


def _load(folder) -> HookedMDM:
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("round5a")
    cache: dict = {}

    def get(name: str):
        if name in cache:
            return cache[name]
        if name in ("llada", "dream", "llada2", "sdar", "fastdllm_v2"):
            m = family_model(name, root / name)
        elif name.startswith("tiny-"):
            m = HookedMDM.from_pretrained(f"mdm-lens/{name}")
        elif name in ("mdlm", "mdlm_tc", "duo"):
            config = dict(DUO_CONFIG) if name == "duo" else dict(MDLM_CONFIG, time_conditioning=name == "mdlm_tc")
            m = _load(write_ddit(root / name, config, seed=3)[0])
        elif name in ("bd3lm", "bd3lm_tc"):
            m = _load(write_bd3lm(root / name, dict(BD3LM_CONFIG, time_conditioning=name == "bd3lm_tc"), seed=4)[0])
        else:
            writer = dict(gidd=write_gidd, rnd1=write_rnd1, coda=write_coda, nemotron=write_nemotron)[name]
            m = _load(writer(root / name)[0])
        cache[name] = m
        return m
    return get


def _count_forwards(model):
    """Every forward runs block 0: a torch pre-hook on it counts forwards whatever path the sampler takes."""
    count = [0]
    handle = model.blocks[0].register_forward_pre_hook(lambda mod, args: count.__setitem__(0, count[0] + 1))
    return count, handle


# --- class: every registered sampler on every family: runs, or SamplerConfigError before any forward -------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampler", [n for n in registry.names()])
def test_every_sampler_on_every_family_runs_or_is_refused_before_any_forward(models, sampler, family):
    model = models(family)
    kw = SETTINGS.get(sampler, dict(gen_length=8, steps=4))
    count, handle = _count_forwards(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(PROMPT, sampler=sampler, **kw)
        ran = True
    except SamplerConfigError as e:
        ran, message = False, str(e)
        assert count[0] == 0, f"{sampler} on {family}: refused after {count[0]} forwards"
    finally:
        handle.remove()
    fam = model.cfg.family
    own = getattr(registry.get(sampler), "family", None)
    plain = sampler in PLAIN_CANVAS and fam == "mdlm" and not model.cfg.extra["time_conditioning"]
    not_written_for = (own is not None and fam != own) or (own is None and fam in DDIT_FAMILIES and not plain)
    if not_written_for:
        assert not ran and f"sampler={sampler!r} cannot run this {fam!r} model" in message
        assert "Samplers for it:" in message
    if ran:
        assert count[0] > 0


# --- S2: a sampler without σ on a time-conditioned DDiT model --------------------------------------------------
@pytest.mark.parametrize("sampler", ["llada", "dream", "coda"])
def test_samplers_without_sigma_are_refused_on_a_time_conditioned_mdlm(models, sampler):
    model = models("mdlm_tc")
    with pytest.raises(SamplerConfigError, match="conditioned on the noise level") as e:
        model.generate(PROMPT, gen_length=8, steps=4, sampler=sampler)
    assert e.value.argument == "sampler" and e.value.value == sampler and e.value.allowed == "'mdlm'"


def test_samplers_without_sigma_still_run_an_mdlm_that_zeroes_sigma(models):
    """σ never reaches a non-time-conditioned MDLM: the LLaDA sampler's forwards equal the MDLM sampler's σ-free
    ones, so it stays allowed (and the MDLM sampler's σ per step is what hook_sigma sees on the conditioned twin)."""
    seen = []
    out = models("mdlm").generate(PROMPT, gen_length=8, steps=4, sampler="llada",
                                  fwd_hooks=[("hook_sigma", lambda x, hook: seen.append(x.clone()))])
    assert out.tokens.shape == (1, 12) and len(seen) == 4 and all(bool((s == 0).all()) for s in seen)
    sig = []
    models("mdlm_tc").generate(PROMPT, gen_length=8, steps=4, sampler="mdlm",
                               fwd_hooks=[("hook_sigma", lambda x, hook: sig.append(float(x[0])))])
    t = torch.linspace(1, 1e-5, 5)[:4]
    assert sig[:4] == pytest.approx((-torch.log1p(-(1 - 1e-3) * t)).tolist(), rel=1e-5)


# --- C1: the BD3LM / GIDD samplers on another family ------------------------------------------------------------
@pytest.mark.parametrize("sampler,family", [("gidd", "mdlm"), ("bd3lm", "mdlm"), ("gidd", "tiny-mdm"),
                                            ("bd3lm", "llada2"), ("gidd", "bd3lm")])
def test_bd3lm_and_gidd_samplers_on_another_family_are_a_typed_error(models, sampler, family):
    model = models(family)
    with pytest.raises(SamplerConfigError, match=f"runs {sampler} checkpoints only") as e:
        model.generate(PROMPT, gen_length=8, steps=4, sampler=sampler)
    assert e.value.argument == "sampler" and model.cfg.family in str(e.value)
    from mdm_lens.diffusion.generate import plan
    with pytest.raises(SamplerConfigError, match="cannot run"):
        plan(model, sampler=sampler, gen_length=8)


# --- S3: BD3LM context_size under kv_cache ------------------------------------------------------------------------
def test_bd3lm_context_size_with_kv_cache_is_refused_as_inert(models):
    bd3 = models("bd3lm")
    with pytest.raises(SamplerConfigError, match="context_size=8 has no effect.*unless kv_cache=False") as e:
        bd3.generate(torch.tensor([[1]]), gen_length=15, steps=4, kv_cache=True, context_size=8, first_hitting=False)
    assert e.value.argument == "context_size"
    # recomputing honours it: windows 4 and 16 see different keys, so the samples differ
    outs = [bd3.generate(torch.tensor([[1]]), gen_length=15, steps=4, context_size=c, first_hitting=False, seed=0)
            .tokens for c in (4, 16)]
    assert not torch.equal(*outs)


# --- C2: TransformerLens cache helpers on a DDiT cache -----------------------------------------------------------
@pytest.mark.parametrize("helper", ["stack_head_results", "get_full_resid_decomposition", "logit_attrs",
                                    "decompose_resid_ln", "apply_ln_to_stack", "stack_neuron_results"])
def test_tl_cache_helpers_that_need_tl_blocks_are_refused_on_ddit(models, helper):
    model = models("mdlm_tc")
    _, c = model.run_with_cache(torch.tensor([[3, 4, 5, 6, 7]]), sigma=0.5)
    call = dict(stack_head_results=lambda: c.stack_head_results(layer=-1),
                get_full_resid_decomposition=lambda: c.get_full_resid_decomposition(),
                logit_attrs=lambda: c.logit_attrs(c["resid_post", -1], tokens=torch.tensor([5]), pos_slice=-1),
                decompose_resid_ln=lambda: c.decompose_resid(layer=-1, apply_ln=True),
                apply_ln_to_stack=lambda: c.apply_ln_to_stack(c.accumulated_resid(layer=-1), layer=-1),
                stack_neuron_results=lambda: c.stack_neuron_results(layer=-1))[helper]
    with pytest.raises(ArgumentError, match="is not defined for a HookedDDiT cache.*Supported here: indexing"):
        call()


def test_ddit_cache_decomposition_that_is_supported_sums_to_the_residual(models):
    model = models("mdlm_tc")
    _, c = model.run_with_cache(torch.tensor([[3, 4, 5, 6, 7]]), sigma=0.5)
    parts = c.decompose_resid(layer=-1)
    assert parts.shape[0] == 2 * model.cfg.n_layers + 1  # embed, then gated attn / mlp outputs per layer
    final = c[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(parts.sum(0), final, atol=1e-5 * float(final.abs().max()), rtol=0)
    # the readout the message points to reproduces the forward's logits from that residual
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5, 6, 7]]), sigma=0.5)
        read = model.readout(final, sigma=0.5)
    torch.testing.assert_close(read, logits, atol=1e-5 * float(logits.abs().max()), rtol=0)


# --- C3: sigma_of_steps on a run without σ ------------------------------------------------------------------------
def test_sigma_of_steps_refuses_a_run_without_sigma_and_reads_a_ddit_run(models):
    from mdm_lens.probes.conditioning import sigma_of_steps

    out = models("tiny-mdm").generate(torch.tensor([[10, 11, 12]]), gen_length=4, steps=2)
    with pytest.raises(ArgumentError, match="records no σ per step") as e:
        sigma_of_steps(out)
    assert e.value.argument == "out"
    run = models("mdlm_tc").generate(PROMPT, gen_length=8, steps=4, sampler="mdlm", noise_removal=False)
    t = torch.linspace(1, 1e-5, 5)[:4]
    torch.testing.assert_close(sigma_of_steps(run)[:, 0], -torch.log1p(-(1 - 1e-3) * t), rtol=1e-5, atol=0)


# --- UNCLEAR: t= keyword, GIDD's length key, attention_mask shape ---------------------------------------------------
@pytest.mark.parametrize("family,match", [("gidd", "pass sigma=t"), ("mdlm_tc", "pass sigma="), ("bd3lm", "sigma=")])
def test_a_time_keyword_points_to_sigma(models, family, match):
    with pytest.raises(InputError, match=match) as e:
        models(family)(torch.tensor([[3, 4, 5]]), t=0.5)
    assert e.value.argument == "t"
    with pytest.raises(InputError, match="did you mean sigma="):
        models(family)(torch.tensor([[3, 4, 5]]), sigmma=0.5)


def test_gidd_length_message_names_its_config_key(models):
    g = models("gidd")
    n = g.cfg.n_ctx
    with pytest.raises(InputError, match=f"max_seq_len in its config.json\\) is {n}"):
        g(torch.randint(0, 40, (1, n + 1)), sigma=0.5)
    with pytest.raises(InputError, match="model_length in its config.json"):
        models("mdlm")(torch.randint(0, 40, (1, models("mdlm").cfg.n_ctx + 1)))


@pytest.mark.parametrize("mask,match", [(torch.ones(2, 7), "shape"), (torch.full((2, 8), 2), "other than 0 and 1"),
                                        ([[1] * 8] * 2, "expected a tensor")])
def test_ddit_attention_mask_is_checked_even_when_it_pads_nothing(models, mask, match):
    with pytest.raises(InputError, match=match) as e:
        models("mdlm")(torch.randint(0, 40, (2, 8)), attention_mask=mask)
    assert e.value.argument == "attention_mask"
    models("mdlm")(torch.randint(0, 40, (2, 8)), attention_mask=torch.ones(2, 8, dtype=torch.long))


# --- UNCLEAR: range messages agree with the check ------------------------------------------------------------------
@pytest.mark.parametrize("family,sampler,name,value,interval", [
    ("mdlm", "mdlm", "eps", 0.0, "(0, 1)"), ("mdlm", "mdlm", "eps", float("nan"), "(0, 1)"),
    ("duo", "duo", "eps", 1.0, "(0, 1)"), ("duo", "duo", "p_nucleus", 0.0, "(0, 1]"),
    ("duo", "duo", "p_nucleus", 1.5, "(0, 1]"), ("bd3lm", "bd3lm", "nucleus_p", 1.1, "(0, 1]"),
    ("bd3lm", "bd3lm", "nucleus_p", 0.0, "(0, 1]"), ("gidd", "gidd", "min_p", -0.1, "[0, 1)"),
    ("gidd", "gidd", "min_p", 1.0, "[0, 1)")])
def test_range_messages_state_the_interval_the_check_applies(models, family, sampler, name, value, interval):
    with pytest.raises(SamplerConfigError) as e:
        registry.get(sampler).settings(models(family), {name: value})
    assert e.value.argument == name and f"in {interval}" in str(e.value)


@pytest.mark.parametrize("sampler,family", [("mdlm", "mdlm"), ("duo", "duo"), ("bd3lm", "bd3lm"), ("gidd", "gidd")])
def test_every_number_rule_of_the_ddit_samplers_agrees_with_resolve_at_its_ends(models, sampler, family):
    """Class check: a value the rules table accepts is not refused by `resolve` for its range, and vice versa."""
    s = registry.get(sampler)
    for name, rule in s.Settings.rules.items():
        if rule.check is None:
            continue
        for v in (0.0, 1.0, 0, 1, 1e-9, 0.999999):
            try:
                rule.check(v, name)
                rule_ok = True
            except ArgumentError:
                rule_ok = False
            try:
                s.settings(models(family), {**rule.on, name: v})
                resolve_ok = True
            except ArgumentError as e:
                resolve_ok = e.argument != name or "is invalid: expected" not in str(e)
            assert rule_ok == resolve_ok or not rule_ok, (sampler, name, v)


# --- UNCLEAR: noise_level's layers ------------------------------------------------------------------------------
def test_noise_level_layers_follow_the_library_selection(models):
    from mdm_lens.probes.noise_level import noise_level

    model = models("mdlm_tc")
    x = torch.tensor([[3, 4, model.cfg.mask_token_id, 6]])
    last = noise_level(model, x, [0.1], layers=[-1])
    ref = noise_level(model, x, [0.1], layers=[model.cfg.n_layers - 1])
    assert last.extra["layers"] == [model.cfg.n_layers - 1]
    torch.testing.assert_close(last.top1_share, ref.top1_share)
    for bad, err in (([], "at least one layer"), ([0, 0], "each layer at most once"), ([model.cfg.n_layers], "expected a layer")):
        with pytest.raises(OutOfRangeError, match=err) as e:
            noise_level(model, x, [0.1], layers=bad)
        assert e.value.argument.startswith("layers")


# --- UNCLEAR: BD3LM leaving masks in the answer ------------------------------------------------------------------
def test_bd3lm_with_too_few_steps_warns_masked_answer(models):
    bd3 = models("bd3lm")
    mask = bd3.cfg.mask_token_id
    with pytest.warns(MaskedAnswerWarning, match=f"still holds the mask id {mask}"):
        out = bd3.generate(torch.tensor([[1]]), gen_length=7, steps=1, seed=0)
    assert int((out.tokens[0, 1:] == mask).sum()) == 5  # first hitting: one position per step and block, 2 of 7 set
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaskedAnswerWarning)
        bd3.generate(torch.tensor([[1]]), gen_length=7, steps=8, seed=0)  # enough steps: no warning
