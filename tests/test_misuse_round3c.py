"""Round 3c of misuse checks (held-out audit, findings 2, 3, 6, 7, 10, 15 and the unclear SAE-export /
features_from_cache ones): each test pins a class of input that used to pass silently or fail misleadingly."""

import warnings

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import SamplerConfigError

CFG = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49)
PROMPT = torch.tensor([[3, 7, 11, 2]])


@pytest.fixture(scope="module")
def mdm():
    return HookedMDM.from_config(MDMConfig(**CFG), seed=1, init_std=0.2, init="realistic")


@pytest.fixture(scope="module")
def dream():
    return HookedMDM.from_config(MDMConfig(**CFG, family="dream", logit_shift=True), seed=2, init_std=0.2,
                                 init="realistic")


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


# --- finding 2: steps= under a rule that decides the number of forwards ------------------------------------------
@pytest.mark.parametrize("kw, culprit", [(dict(threshold=0.9), "threshold=0.9"), (dict(factor=1.0), "factor=1.0"),
                                         (dict(sampler_rule="eb"), "sampler_rule='eb'"),
                                         (dict(kv_cache="prefix", threshold=0.9), "threshold=0.9")])
@pytest.mark.parametrize("steps", [2, 1000])
def test_llada_steps_is_refused_where_threshold_factor_or_eb_decide_the_length(mdm, kw, culprit, steps):
    with pytest.raises(SamplerConfigError, match="no effect") as e:
        mdm.generate(PROMPT, gen_length=8, steps=steps, **kw)
    assert e.value.argument == "steps" and e.value.value == steps and culprit in str(e.value)


def test_steps_still_acts_without_those_rules_and_equal_to_gen_length_is_accepted(tiny):
    p = torch.tensor([[1, 5, 6, 7]])
    assert tiny.generate(p, gen_length=8, steps=4).trajectory.n_steps == 4
    # kv_cache alone follows the block schedule, where steps counts
    out = tiny.generate(p, gen_length=8, steps=4, block_length=4, kv_cache="prefix")
    assert out.settings["steps"] == 4
    # a passed steps equal to gen_length would be ignored as well: refused (round 7a); unset, it resolves to it
    a = tiny.generate(p, gen_length=8, threshold=0.9)
    assert a.settings["steps"] == 8
    with pytest.raises(SamplerConfigError, match="no effect"):
        tiny.generate(p, gen_length=8, steps=8, threshold=0.9)


def test_dream_steps_is_refused_under_threshold_and_factor(dream):
    for kw, culprit in ((dict(threshold=0.5), "threshold=0.5"), (dict(factor=1.0), "factor=1.0")):
        with pytest.raises(SamplerConfigError, match="no effect") as e:
            dream.generate(PROMPT, gen_length=8, steps=4, kv_cache="dual", block_length=4, **kw)
        assert e.value.argument == "steps" and culprit in str(e.value)
    assert dream.generate(PROMPT, gen_length=8, steps=4, kv_cache="dual", block_length=4).settings["steps"] == 4


# --- finding 3: LLaDA2 answers that still hold the mask id ------------------------------------------------------
def _llada2(seed):
    import json
    import tempfile
    from pathlib import Path

    from mdm_lens.loading import read_config

    c = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256,
             architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", num_key_value_heads=2,
             intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_shared_experts=1,
             num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, mask_token_id=63,
             block_length=4, eos_token_id=62)
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(c))
    cfg, _ = read_config(d, "llada2", None)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3, init="realistic")


def _run_recording(model, prompt, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = model.generate(prompt, **kw)
    from mdm_lens.diffusion import MaskedAnswerWarning

    return out, [x for x in w if issubclass(x.category, MaskedAnswerWarning)]


def test_llada2_warns_when_its_answer_holds_the_mask_id_and_commit_step_says_why():
    torch.manual_seed(1)
    q = torch.randint(0, 60, (1, 5))
    out, caught = _run_recording(_llada2(1), q, gen_length=8)
    span = out.tokens[0, 5:5 + out.answer_length[0]]
    masked = (span == 63).nonzero().flatten().tolist()
    assert masked, "planted case: this seed's model samples the mask id"
    assert len(caught) == 1 and f"answer positions {masked}" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's generate line
    cs = out.trajectory.commit_step[0, 5:5 + out.answer_length[0]]
    assert (cs[masked] == -2).any()  # never committed: the documented -2
    assert ((cs == -2) <= (span == 63)).all()  # a never-committed position is a mask in the answer


def test_llada2_masks_after_the_eos_stop_are_outside_the_answer_and_do_not_warn():
    torch.manual_seed(1)
    q = torch.randint(0, 60, (1, 5))
    out, caught = _run_recording(_llada2(3), q, gen_length=8)
    assert out.answer_length == [1] and out.tokens[0, 5] == 62  # EOS first: the answer is that one token
    # the blocks after the one holding EOS never ran (block_length 4: positions 8.. of the canvas)
    assert (out.tokens[0, 8:] == 63).all() and (out.trajectory.commit_step[0, 8:] == -2).all()
    assert caught == []


# --- finding 6: hooks bound to a phase the run never has ---------------------------------------------------------
def _never(x, hook):
    raise AssertionError("must not run")


@pytest.mark.parametrize("how", ["hook_steps", "at_steps", "tuple_bound"])
@pytest.mark.parametrize("phases, kw", [(("uncond",), {}), ("encoder", {}), (("uncond",), dict(sampler="dream"))])
def test_a_hook_on_a_phase_that_never_runs_is_refused_as_cache_is(mdm, how, phases, kw):
    from mdm_lens import at_steps, steps

    sel = steps(phases=phases)
    hooks = {"hook_steps": dict(fwd_hooks=[("blocks.0.hook_resid_pre", _never)], hook_steps=sel),
             "at_steps": dict(fwd_hooks=[at_steps(_never, sel, name="blocks.0.hook_resid_pre")]),
             "tuple_bound": dict(fwd_hooks=[("blocks.0.hook_resid_pre", at_steps(_never, steps(0, phases=phases)))])}
    with pytest.raises(SamplerConfigError, match="never run under these settings") as e:
        mdm.generate(PROMPT, steps=4, gen_length=4, **kw, **hooks[how])
    assert e.value.argument == "phases"
    assert not any(h.fwd_hooks for h in mdm.hook_dict.values())


def test_hooks_on_phases_that_run_still_fire(mdm):
    from mdm_lens import at_steps, steps

    seen = []
    spy = lambda x, hook: seen.append(mdm.state.phase)  # noqa: E731
    mdm.generate(PROMPT, steps=2, gen_length=2, cfg_scale=0.5,
                 fwd_hooks=[at_steps(spy, steps(phases=("uncond",)), name="hook_embed")])
    assert seen == ["uncond", "uncond"]
    seen.clear()
    mdm.generate(PROMPT, steps=2, gen_length=2, fwd_hooks=[("hook_embed", spy)], hook_steps=steps(phases=("cond", "uncond")))
    assert seen == ["cond", "cond"]  # a selection listing a phase that runs passes, and fires there


# --- finding 7: another sampler's default is not a do-nothing value ----------------------------------------------
@pytest.mark.parametrize("sampler, option, value", [
    ("dream", "remasking", "low_confidence"), ("dream", "sampler_rule", "llada"), ("llada", "alg", "origin"),
    ("llada", "eps", 1e-3), ("llada", "remasking_strategy", "low_confidence_dynamic"),
    ("llada", "minimal_topk", 1)])
def test_another_samplers_algorithm_choice_is_refused(mdm, sampler, option, value):
    with pytest.raises(SamplerConfigError, match=f"unknown setting {option}=") as e:
        mdm.generate(PROMPT, sampler=sampler, gen_length=4, **{option: value})
    assert e.value.argument == option
    if option == "remasking":
        assert "alg='maskgit_plus'" in str(e.value)  # the hint to Dream's confidence order


def test_true_no_op_values_of_other_samplers_still_pass(mdm):
    out = mdm.generate(PROMPT, sampler="dream", gen_length=4, steps=4, cfg_scale=0.0, logits_eos_inf=False,
                       stop_at_eos=False, kv_cache=None, threshold=None)
    assert out.sampler == "dream"
    assert mdm.generate(PROMPT, gen_length=4, alg_temp=None, top_k=None, top_p=None).sampler == "llada"


def test_arm_filters_at_temperature_zero_are_refused_and_act_above_it(tiny):
    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    p = torch.tensor([[1, 5, 6, 7]])
    for kw in (dict(top_k=5), dict(top_p=0.01), dict(top_k=5, temperature=0)):
        with pytest.raises(SamplerConfigError, match="no effect.*temperature > 0") as e:
            arm.generate(p, gen_length=4, **kw)
        assert e.value.argument in ("top_k", "top_p")
    a = arm.generate(p, gen_length=4, temperature=1.0, top_k=1, seed=0)
    assert torch.equal(a.tokens, arm.generate(p, gen_length=4).tokens)  # top-1 sampling is greedy: the filter acts


# --- finding 10: targets=[] equals clean to fp32 rounding (README's claim), not bit for bit -----------------------
def test_knockout_empty_targets_matches_clean_to_fp32_rounding(tiny):
    from mdm_lens.probes import knockout

    res = knockout(tiny, torch.tensor([[1, 5, 6, 7, 9]]), targets=[], n_random=0, gen_length=4, n_steps=4)
    i, j = res.conditions.index("clean"), res.conditions.index("targets")
    clean, empty = float(res.value[i]), float(res.value[j])
    assert abs(clean - empty) <= 1e-5 * max(1.0, abs(clean))
    assert float(res.agreement[j]) == 1.0


# --- finding 15: block samplers on a bidirectional model without a block length -----------------------------------
@pytest.mark.parametrize("sampler, kw", [("sdar", dict(temperature=1.0)), ("llada2", {})])
def test_block_samplers_refuse_a_bidirectional_model_without_a_block_length(mdm, sampler, kw):
    assert mdm.cfg.attention == "bidirectional" and mdm.cfg.extra.get("block_length") is None
    with pytest.raises(SamplerConfigError, match="not trained under a block mask") as e:
        mdm.generate(PROMPT, sampler=sampler, gen_length=4, **kw)
    assert e.value.argument == "block_length" and "sampler='llada'" in str(e.value)
    out = mdm.generate(PROMPT, sampler=sampler, gen_length=4, block_length=2, **kw)  # explicit: the caller's choice
    assert out.settings["block_length"] == 2


def test_block_samplers_take_a_block_causal_models_default():
    cfg = MDMConfig(**CFG, attention="block_causal")
    m = HookedMDM.from_config(cfg, seed=4, init_std=0.2, init="realistic")
    assert m.generate(PROMPT, sampler="llada2", gen_length=4).settings["block_length"] == 32
    m.cfg.extra["block_length"] = 2  # the checkpoint's value wins over the reference default
    assert m.generate(PROMPT, sampler="sdar", gen_length=4, temperature=1.0).settings["block_length"] == 2


# --- unclear: the SAE export on Fast-dLLM v2 (no `steps`, its own length names) ----------------------------------
def _fdv2():
    import json
    import tempfile
    from pathlib import Path

    from mdm_lens.loading import read_config

    c = dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=8, vocab_size=64,
             hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rope_theta=1e6, mask_token_id=63, pad_token_id=0)
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(c))
    cfg, _ = read_config(d, "fdv2", None)
    return HookedMDM.from_config(cfg, seed=0, init_std=0.3, init="realistic")


def test_sae_export_runs_on_fastdllm_v2_under_either_length_name(tmp_path):
    import numpy as np

    from mdm_lens.sae import export_activations

    fd = _fdv2()
    kw = dict(small_block_size=4, stop_token=62)
    a = export_activations(fd, [[1, 2, 3, 4, 5]], "blocks.1.hook_resid_post", out=tmp_path / "a",
                           sampler_kwargs=dict(kw, max_new_tokens=16))
    b = export_activations(fd, [[1, 2, 3, 4, 5]], "blocks.1.hook_resid_post", out=tmp_path / "b", gen_length=16,
                           sampler_kwargs=kw)
    assert a.num_rows == b.num_rows > 0
    assert np.array_equal(np.asarray(a["blocks.1.hook_resid_post"]), np.asarray(b["blocks.1.hook_resid_post"]))
    assert max(a["position"]) < 5 + 16
    with pytest.raises(SamplerConfigError, match="no such setting") as e:
        export_activations(fd, [[1, 2, 3]], "blocks.1.hook_resid_post", out=tmp_path / "c", n_steps=4,
                           sampler_kwargs=dict(kw, max_new_tokens=16))
    assert e.value.argument == "n_steps"


# --- unclear: features_from_cache's default layers are the cached ones --------------------------------------------
def test_features_from_cache_defaults_to_the_cached_layers(mdm):
    from mdm_lens import TrajectoryCache
    from mdm_lens.errors import InputError
    from mdm_lens.lens import features_from_cache

    out = mdm.generate(PROMPT, steps=4, gen_length=4, cache=TrajectoryCache(["blocks.1.hook_resid_post"]))
    f = features_from_cache(out.cache)
    assert list(f.layers) == [1]
    expect = out.cache.stack("blocks.1.hook_resid_post", align=True).mean(-2)  # [step, item, d], mean over positions
    torch.testing.assert_close(f.acts[0].float(), expect.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="layers\\[0\\]"):  # an explicit uncached layer is still refused by name
        features_from_cache(out.cache, layers=[0])
