"""Held-out misuse findings, round ten (misuse17's U2 and the run on the final main): each test fails on the code
before its fix."""

from __future__ import annotations

import json

import pytest
import torch

from mdm_lens.errors import SamplerConfigError
from test_fastdllm_v2 import planted_model


def test_fastdllm_v2_blames_a_block_size_that_does_not_divide_32_before_the_small_block_default():
    # block_size=3 is wrong whatever small_block_size is (the reference masks over 32-token blocks); blaming the
    # untouched small_block_size=8 default first sent the user to "fix" it and then meet this error anyway.
    model = planted_model()
    with pytest.raises(SamplerConfigError) as e:
        model.generate([[20, 21]], sampler="fastdllm_v2", block_size=3, max_new_tokens=16, stop_token=1)
    assert e.value.argument == "block_size" and e.value.value == 3 and "divide 32" in str(e.value)


@pytest.fixture(scope="module")
def tiny():
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_at_steps_with_an_empty_list_is_refused_as_hook_steps_is():
    # steps() of nothing is "every step": an explicit [] must not mean that (misuse18 S1)
    from mdm_lens import at_steps

    for named in ({"name": "blocks.0.hook_resid_pre"}, {}):
        with pytest.raises(SamplerConfigError, match="selects no step"):
            at_steps(lambda x, hook: None, [], **named)
    assert at_steps(lambda x, hook: None, None, name="blocks.0.hook_resid_pre").when.indices == ()


def test_a_hook_or_cache_named_on_a_step_that_ran_no_forward_is_warned_about():
    # MDLM's ddpm_cache reuses p(x0) at steps where nothing changed: a hook / cache pinned there did nothing
    # (misuse18 S2); the warning names exactly the steps that ran no forward
    import warnings

    from mdm_lens import at_steps, steps
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.hooks.runner import StepsNotReachedWarning

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=32, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0, init_std=0.2)
    p = torch.tensor([[3, 14, 15]])
    ran = []
    m.generate(p, gen_length=4, steps=16, seed=0, fwd_hooks=[("hook_embed", lambda x, hook: ran.append(m.state.step))])
    idle = sorted(set(range(16)) - set(ran))
    assert idle and ran  # the run has steps with and without a forward
    asked = [idle[0], ran[0]]
    fired = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = m.generate(p, gen_length=4, steps=16, seed=0, cache="blocks.0.hook_resid_post" @ steps(*asked),
                         fwd_hooks=[at_steps(lambda x, hook: fired.append(m.state.step), asked,
                                             name="blocks.0.hook_resid_pre")])
    got = [str(x.message) for x in w if issubclass(x.category, StepsNotReachedWarning)]
    assert fired == [ran[0]] and out.cache.steps == [ran[0]]
    assert len(got) == 2 and all(f"steps [{idle[0]}] ran no forward" in g for g in got)
    assert got[0].startswith("the hook on blocks.0.hook_resid_pre") and got[1].startswith("cache")
    with warnings.catch_warnings(record=True) as w:  # every step (no explicit step list): nothing to say
        warnings.simplefilter("always")
        m.generate(p, gen_length=4, steps=16, seed=0, fwd_hooks=[("hook_embed", lambda x, hook: None)])
    assert not [x for x in w if issubclass(x.category, StepsNotReachedWarning)]


def test_generate_warns_about_leading_pads_without_a_mask_as_the_forward_does(tiny):
    import warnings

    prompt = torch.tensor([[35, 28, 107, 29, 36], [0, 0, 0, 0, 35]])  # to_tokens left-pads with the pad id 0
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tiny.generate(prompt, steps=2, gen_length=2)
    assert any("start with the pad id 0 but no attention_mask" in str(x.message) for x in w)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tiny.generate(prompt, attention_mask=(prompt != 0).long(), steps=2, gen_length=2)
    assert not any("pad id" in str(x.message) for x in w)


def test_caches_refuse_the_meta_device(tiny):
    from mdm_lens import TrajectoryCache
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match="holds shapes but no values") as e:
        TrajectoryCache("blocks.0.hook_resid_post", device="meta")
    assert e.value.argument == "device"
    with pytest.raises(ArgumentError, match="holds shapes but no values"):
        tiny.run_with_cache(torch.tensor([[5, 6, 7]]), device="meta")
    assert TrajectoryCache("blocks.0.hook_resid_post", device="cpu").device == torch.device("cpu")


def test_backward_hooks_under_no_grad_are_refused(tiny):
    from mdm_lens.errors import InputError

    toks = torch.tensor([[5, 6, 7, 8, 9, 10]])
    x = toks.clone()
    x[0, 3:] = tiny.cfg.mask_token_id
    hook = [("blocks.1.hook_resid_post", lambda g, hook: None)]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), pytest.raises(InputError, match="could never run") as e:
            tiny.run_with_hooks(x, return_type="loss", targets=toks, reset_hooks_end=False, bwd_hooks=hook)
        assert e.value.argument == "bwd_hooks"
    assert not any(hp.bwd_hooks for hp in tiny.hook_dict.values())
    got = []  # with gradients on, the same call works and the hook runs on backward
    loss = tiny.run_with_hooks(x, return_type="loss", targets=toks, reset_hooks_end=False,
                               bwd_hooks=[("blocks.1.hook_resid_post", lambda g, hook: got.append(g.shape))])
    loss.backward()
    tiny.reset_hooks()
    assert got == [torch.Size([1, 6, tiny.cfg.d_model])]
    with torch.no_grad():  # forward hooks alone are fine there
        tiny.run_with_hooks(x, fwd_hooks=[("blocks.1.hook_resid_post", lambda a, hook: None)])


def test_sweep_run_names_data_that_is_not_a_path(tmp_path, tiny):
    import mdm_lens.sweep as SW
    from mdm_lens.errors import ArgumentTypeError

    for data in ([{"id": "a", "prompt": "where was garvin born ?"}], None, 123):
        with pytest.raises(ArgumentTypeError, match="path of a .jsonl file") as e:
            SW.run(tiny, data, ["absorption"], tmp_path / "o")
        assert e.value.argument == "data"


def test_globs_work_in_run_with_hooks_add_hook_and_run_with_cache(tiny):
    from mdm_lens.errors import HookNameError

    p = torch.tensor([[5, 6, 7, 8]])
    seen = []
    tiny.run_with_hooks(p, fwd_hooks=[("blocks.*.hook_resid_pre", lambda x, hook: seen.append(hook.name))])
    assert seen == [f"blocks.{i}.hook_resid_pre" for i in range(tiny.cfg.n_layers)]
    _, cache = tiny.run_with_cache(p, names_filter=["hook_embed", "blocks.[12].attn.hook_pattern"])
    assert sorted(cache.keys()) == ["blocks.1.attn.hook_pattern", "blocks.2.attn.hook_pattern", "hook_embed"]
    _, cache = tiny.run_with_cache(p, names_filter="blocks.?.ln1.hook_scale")
    assert len(cache.keys()) == tiny.cfg.n_layers
    seen.clear()
    tiny.add_hook("blocks.[03].hook_resid_post", lambda x, hook: seen.append(hook.name))
    try:
        tiny(p)
    finally:
        tiny.reset_hooks()
    assert seen == ["blocks.0.hook_resid_post", "blocks.3.hook_resid_post"]
    edited = tiny.run_with_hooks(p, fwd_hooks=[("blocks.*.hook_resid_post", lambda x, hook: x * 0)])
    by_name = tiny.run_with_hooks(p, fwd_hooks=[(f"blocks.{i}.hook_resid_post", lambda x, hook: x * 0)
                                                for i in range(tiny.cfg.n_layers)])
    torch.testing.assert_close(edited, by_name, atol=0, rtol=0)
    for bad in (lambda: tiny.run_with_hooks(p, fwd_hooks=[("blocks.*.hook_nope", lambda x, hook: None)]),
                lambda: tiny.run_with_cache(p, names_filter="nope.*"),
                lambda: tiny.add_hook("zz*", lambda x, hook: None)):
        with pytest.raises(HookNameError, match="matches no hook point"):
            bad()
    assert not any(hp.fwd_hooks for hp in tiny.hook_dict.values())


def test_add_hook_names_the_allowed_directions(tiny):
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match="'fwd', 'bwd'") as e:
        tiny.add_hook("blocks.0.hook_resid_pre", lambda x, hook: None, dir="backward")
    assert e.value.argument == "dir"


def test_a_circuit_index_error_names_the_circuits_shape(tiny):
    from mdm_lens.errors import InputTypeError, OutOfRangeError

    n, h, d = tiny.cfg.n_layers, tiny.cfg.n_heads, tiny.cfg.d_model
    with pytest.raises(OutOfRangeError, match=rf"shape \({n}, {h}, {d}, {d}\)"):
        tiny.OV[n]
    with pytest.raises(OutOfRangeError, match=rf"shape \({h}, {d}, {d}\)"):
        tiny.QK[0][h]
    with pytest.raises(InputTypeError):
        tiny.OV["a"]
    torch.testing.assert_close(tiny.OV[1][2].AB, tiny.W_V[1, 2] @ tiny.W_O[1, 2])


def test_a_choice_that_allows_none_lists_none_in_its_refusal():
    from mdm_lens.diffusion.ddit import DuoSettings

    with pytest.raises(SamplerConfigError, match="'ancestral', 'greedy', None"):
        DuoSettings(noise_removal="foo").resolve(None)


def _fastdllm(eos: int | None):
    from mdm_lens import HookedMDM, MDMConfig

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, d_vocab=64, mask_token_id=63,
                    attention="bidirectional", logit_shift=True, n_ctx=128, pad_token_id=0, eos_token_id=eos,
                    family="fastdllm_v2", extra={"block_length": 8})
    return HookedMDM.from_config(cfg, seed=1, init_std=0.5)  # seed 0's top token is the mask id


def test_export_refuses_two_spellings_of_one_length_with_different_values(tmp_path):
    # gen_length / block_length and sampler_kwargs' max_new_tokens / block_size are one setting each on Fast-dLLM v2;
    # the export's names silently won (misuse18 S4)
    from mdm_lens.errors import ArgumentError
    from mdm_lens.sae import export_activations

    model, prompt = _fastdllm(eos=62), [[5, 17, 33, 2, 61, 40, 9, 12, 44, 3]]
    for kw, argument in ((dict(gen_length=16, sampler_kwargs={"max_new_tokens": 24}), "gen_length"),
                         (dict(gen_length=16, block_length=8, sampler_kwargs={"block_size": 16}), "block_length")):
        with pytest.raises(ArgumentError, match="different values") as e:
            export_activations(model, prompt, "blocks.1.hook_resid_post", out=tmp_path / argument, **kw)
        assert e.value.argument == argument
    ds = export_activations(model, prompt, "blocks.1.hook_resid_post", out=tmp_path / "same", positions="all",
                            gen_length=16, sampler_kwargs={"max_new_tokens": 16, "threshold": 1.0})
    manifest = json.loads((tmp_path / "same" / "manifest.json").read_text())
    assert manifest["arguments"]["settings"]["max_new_tokens"] == 16
    run = model.generate(prompt, max_new_tokens=16, threshold=1.0, progress=False)
    assert max(ds["step"]) + 1 == run.trajectory.n_steps


def test_export_says_a_missing_sampler_setting_goes_in_sampler_kwargs(tmp_path):
    from mdm_lens.sae import export_activations

    with pytest.raises(SamplerConfigError, match=r"sampler_kwargs=\{'stop_token': \.\.\.\}") as e:
        export_activations(_fastdllm(eos=None), [[5, 17, 33, 2]], "blocks.1.hook_resid_post", out=tmp_path / "x",
                           gen_length=16)
    assert e.value.argument == "stop_token"


def test_noise_level_refuses_a_repeated_level():
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.noise_level import noise_level

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=True)
    m = HookedDDiT.from_config(cfg, seed=0)
    toks = torch.tensor([[3, 5, 7, 9, cfg.mask_token_id, cfg.mask_token_id]])
    with pytest.raises(ArgumentError, match=r"repeats \[0\.5\]") as e:
        noise_level(m, toks, levels=[0.5, 2.0, 0.5])
    assert e.value.argument == "levels"
    assert noise_level(m, toks, levels=[0.5, 2.0]).anchor_share.shape[0] == 2


# --- misuse19 ---------------------------------------------------------------------------------------------------

def test_a_negative_cache_step_counts_from_the_end_of_the_run_as_steps_does(tiny):
    from mdm_lens import steps
    from mdm_lens.errors import ArgumentTypeError, InputError, OutOfRangeError

    p = torch.tensor([[1, 5, 32, 49, 50, 34, 117, 43]])
    out = tiny.generate(p, steps=4, gen_length=4, cache="blocks.0.hook_resid_post" @ steps(1, 2))
    same = tiny.generate(p, steps=4, gen_length=4, cache="blocks.0.hook_resid_post" @ steps(-2))
    assert out.cache.steps == [1, 2] and same.cache.steps == [2]
    name = "blocks.0.hook_resid_post"
    torch.testing.assert_close(out.cache[-2][name], out.cache[2][name], atol=0, rtol=0)
    torch.testing.assert_close(out.cache[-3][name], out.cache[1][name], atol=0, rtol=0)
    with pytest.raises(InputError, match=r"step 3 was not cached; cached steps: \[1, 2\]"):
        out.cache[-1]  # the run's last step, which was not cached (not the last cached one)
    with pytest.raises(OutOfRangeError, match="the run had 4 step"):
        out.cache[-5]
    with pytest.raises(ArgumentTypeError, match=r"write cache\[1\]\['blocks.0.hook_resid_post'\]"):
        out.cache[1, name]


def test_an_adaptive_runs_cache_counts_negative_steps_from_the_forwards_it_made():
    # Fast-dLLM v2 decides its length as it runs: -1 is its last forward, not the planned bound
    from test_fastdllm_v2 import planted_model

    model = planted_model()
    out = model.generate([[20, 21]], sampler="fastdllm_v2", block_size=4, small_block_size=4, max_new_tokens=8,
                         threshold=0.0, stop_token=1, cache="blocks.0.hook_resid_post")
    n = out.trajectory.n_steps
    assert out.cache.n_run == n and out.cache.steps[-1] == n - 1
    torch.testing.assert_close(out.cache[-1]["blocks.0.hook_resid_post"],
                               out.cache[n - 1]["blocks.0.hook_resid_post"], atol=0, rtol=0)


def test_sigma_on_a_model_that_zeroes_it_warns_once_outside_a_sampler():
    import warnings

    from mdm_lens.ddit import HookedDDiT, ddit_config

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0, init_std=0.2)
    x = torch.tensor([[3, 5, 7, 9, 39, 39]])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a, b = m(x, sigma=0.01), m(x, sigma=50.0)
        m(x)
        m.generate(torch.tensor([[3, 5]]), gen_length=4, steps=4)
    said = [str(i.message) for i in w if "sigma= has no effect" in str(i.message)]
    assert torch.equal(a, b) and len(said) == 1 and w[0].filename == __file__
    on = HookedDDiT.from_config(ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2,
                                            n_heads=2, time_conditioning=True), seed=0, init_std=0.2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not torch.equal(on(x, sigma=0.01), on(x, sigma=50.0))
    assert not w


def test_masked_kl_says_why_it_is_nan_when_nothing_was_masked(tiny):
    from mdm_lens.lens import masked_kl

    with pytest.warns(UserWarning, match="no position of the 1 row"):
        kl = masked_kl(tiny, torch.tensor([[1]]), mask_rate=1.0)
    assert kl.isnan().all() and kl.shape == (tiny.cfg.n_layers,)


def test_an_undefined_comparison_states_no_verdict():
    import math

    from mdm_lens.views.stats import Interval, compare

    none = compare(Interval(math.nan, math.nan, math.nan, 0, None, 3, 0.95), "m more", "m less", "m as uniform")
    one = compare(Interval(0.5, math.nan, math.nan, 1, None, 0, 0.95), "m more", "m less", "m as uniform")
    assert none.startswith("undecided whether m as uniform: no item has a value")
    assert one.startswith("undecided whether m as uniform: too few items for an interval")
    tie = compare(Interval(0.1, -0.2, 0.4, 20, None, 0, 0.95), "m more", "m less", "m as uniform")
    assert tie.startswith("m as uniform (tie")


@pytest.fixture(scope="module")
def saved_lens(tiny, tmp_path_factory):
    from mdm_lens.lens import train_tuned_lens

    ids = torch.randint(5, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 1
    folder = tmp_path_factory.mktemp("lens")
    train_tuned_lens(tiny, ids, n_steps=1).save(folder)
    return folder


@pytest.mark.parametrize("damage", ["short_bias", "one_elem_bias", "json_cut", "json_list", "json_no_key",
                                    "weights_cut"])
def test_tuned_lens_load_names_the_damaged_file(tiny, saved_lens, tmp_path, damage):
    import shutil

    from safetensors.torch import load_file, save_file

    from mdm_lens.errors import InputError
    from mdm_lens.lens import TunedLens

    folder = tmp_path / "lens"
    shutil.copytree(saved_lens, folder)
    weights, config = folder / "tuned_lens.safetensors", folder / "tuned_lens.json"
    if damage in ("short_bias", "one_elem_bias"):  # (1,) would broadcast silently under copy_
        sd = load_file(str(weights))
        sd["bias.0"] = sd["bias.0"][:3 if damage == "short_bias" else 1].clone()
        save_file(sd, str(weights))
        match = r"bias\.0 has shape \((3|1),\), expected \(128,\)"
    elif damage == "json_cut":
        config.write_text("{truncated")
        match = "tuned_lens.json is not valid JSON"
    elif damage == "json_list":
        config.write_text("[1, 2]")
        match = "tuned_lens.json is not a tuned-lens config"
    elif damage == "json_no_key":
        cfg = json.loads(config.read_text())
        del cfg["d_model"]
        config.write_text(json.dumps(cfg))
        match = "is not a tuned-lens config"
    else:
        weights.write_bytes(weights.read_bytes()[:40])
        match = "tuned_lens.safetensors is not a readable safetensors file"
    with pytest.raises(InputError, match=match):
        TunedLens.load(folder, tiny)
    assert TunedLens.load(saved_lens, tiny).layers  # the undamaged copy still loads


def test_lists_of_hook_names_work_in_run_with_hooks_hooks_and_add_hook(tiny):
    names = ["blocks.0.hook_resid_pre", "blocks.2.hook_resid_pre"]
    x = torch.tensor([[5, 6, 7, 8]])
    seen = []
    tiny.run_with_hooks(x, fwd_hooks=[(names, lambda t, hook: seen.append(hook.name))])
    with tiny.hooks(fwd_hooks=[(names, lambda t, hook: seen.append(hook.name))]):
        tiny(x)
    tiny.add_hook(names, lambda t, hook: seen.append(hook.name))
    try:
        tiny(x)
    finally:
        tiny.reset_hooks()
    assert seen == names * 3
    from mdm_lens.errors import ArgumentTypeError, HookNameError

    with pytest.raises(HookNameError):
        tiny.run_with_hooks(x, fwd_hooks=[(["blocks.0.hook_resid_pre", "nope"], lambda t, hook: None)])
    with pytest.raises(ArgumentTypeError):
        tiny.add_hook([], lambda t, hook: None)
    assert not any(hp.fwd_hooks for hp in tiny.hook_dict.values())


def test_diffusion_ce_score_says_it_needs_one_hook_point(tiny):
    from mdm_lens.errors import ArgumentTypeError
    from mdm_lens.sae import diffusion_ce_score

    class SAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W_enc = torch.nn.Parameter(torch.randn(128, 16))
            self.W_dec = torch.nn.Parameter(torch.randn(16, 128))

        def encode(self, x):
            return torch.relu(x @ self.W_enc)

        def decode(self, f):
            return f @ self.W_dec

    ids = torch.randint(5, 300, (2, 12))
    for name in ("blocks.*.hook_resid_post", ["blocks.1.hook_resid_post"]):
        with pytest.raises(ArgumentTypeError, match="must name one hook point") as e:
            diffusion_ce_score(tiny, SAE(), name, ids)
        assert e.value.argument == "hook_name"


def test_the_report_says_a_path_is_missing_or_a_file(tmp_path):
    from mdm_lens.errors import InputError
    from mdm_lens.views.sweep_report import load_sweeps

    with pytest.raises(InputError, match="does not exist"):
        load_sweeps(tmp_path / "nope")
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(InputError, match="is a file, not a folder"):
        load_sweeps(tmp_path / "afile")
    with pytest.raises(InputError, match="is not a sweep folder"):
        load_sweeps(tmp_path)  # an existing folder with no sweep keeps its own message


def test_explore_takes_one_label_as_a_str_for_one_run(tiny):
    from mdm_lens.errors import ArgumentTypeError
    from mdm_lens.hooks.reducers import ReceivedAttention
    from mdm_lens.views import explore

    out = tiny.generate(torch.tensor([[1, 5, 32, 49]]), steps=2, gen_length=2, record=[ReceivedAttention()])
    assert explore(out, tiny, labels="tiny").data[0]["label"] == "tiny"
    with pytest.raises(ArgumentTypeError, match="one str for 2 runs"):
        explore([out, out], tiny, labels="tiny")
    with pytest.raises(ArgumentTypeError, match="title"):
        explore(out, tiny, title=5)


# --- misuse20 ---------------------------------------------------------------------------------------------------

def test_retrieval_scores_say_why_nothing_was_counted_and_top_refuses_nan_heads(tiny):
    import warnings

    from mdm_lens.errors import InputError
    from mdm_lens.probes import retrieval as RT
    from mdm_lens.zoo import data as D, tokenizer as ZT

    tok = ZT.load_tokenizer()
    items = [RT.from_qa_item(it, tok) for it in D.make_dataset(2, seed=1234, n_distractors=2)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sc = RT.retrieval_scores(tiny, items, method="copy@commit")
    assert not sc.correct.any() and sc.n_counted == 0 and sc.scores.isnan().all()  # the tiny model misses both
    assert "2 of 2 item(s) were answered wrongly" in sc.notes[0] and "every head's score is NaN" in sc.notes[-1]
    assert any("no item was counted" in str(x.message) for x in w)
    with pytest.raises(InputError, match="no head was scored"):
        sc.top(3)
    mixed = RT.retrieval_scores(tiny, [RT.from_qa_item(it, tok) for it in D.make_dataset(6, seed=0, n_distractors=2)],
                                method="copy@commit")
    wrong = int((~mixed.correct).sum())
    assert 0 < mixed.n_counted and mixed.notes == [f"{wrong} of 6 item(s) were answered wrongly: not counted "
                                                   "(only_correct=True)"]
    scored = int((~mixed.scores.isnan()).sum())
    assert len(mixed.top(scored)) == scored
    with pytest.raises(Exception, match="expected an int in"):
        mixed.top(scored + 1)


def test_diffusion_ce_score_refuses_a_repeated_seed_or_mask_rate(tiny):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.sae import diffusion_ce_score

    class Identity:
        W_dec = torch.eye(128)

        def encode(self, x):
            return x

        def decode(self, f):
            return f

    tok = torch.randint(10, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    for kw, name in ((dict(seeds=(0, 0)), "seeds"), (dict(mask_rates=(0.5, 0.5)), "mask_rates")):
        with pytest.raises(ArgumentError, match="repeats a value") as e:
            diffusion_ce_score(tiny, Identity(), "blocks.1.hook_resid_post", tok, **kw)
        assert e.value.argument == name


def test_a_trajectory_cache_iterates_its_steps_and_answers_in(tiny):
    from mdm_lens import steps

    p = torch.tensor([[10, 11, 12, 13, 14, 15]])
    out = tiny.generate(p, steps=4, gen_length=4, cache="blocks.0.hook_resid_post" @ steps(0, 3))
    assert list(out.cache) == [0, 3] and len(out.cache) == 2
    assert "blocks.0.hook_resid_post" in out.cache and "blocks.1.hook_resid_post" not in out.cache
    assert 3 in out.cache and -1 in out.cache and -4 in out.cache
    assert 1 not in out.cache and -2 not in out.cache and -9 not in out.cache and 2.0 not in out.cache
    assert out.cache.rows_of(-1) == out.cache.rows_of(3) and out.cache.keys_of(-4) == out.cache.keys_of(0)
    assert torch.equal(out.cache.key_positions_of(-1), out.cache.key_positions_of(3))
    assert torch.equal(out.cache.origin_of(-1), out.cache.origin_of(3))
    from mdm_lens.errors import InputError

    with pytest.raises(InputError, match=r"step 2 was not cached; cached steps: \[0, 3\]"):
        out.cache.rows_of(-2)


@pytest.mark.parametrize("where", ["generate", "from_config", "knockout", "export"])
def test_a_seed_beyond_torchs_range_is_a_typed_error(tiny, tmp_path, where):
    from mdm_lens import HookedMDM
    from mdm_lens.errors import ArgumentError

    p = torch.tensor([[10, 11, 12, 13]])
    calls = {"generate": lambda s: tiny.generate(p, steps=2, gen_length=2, seed=s),
             "from_config": lambda s: HookedMDM.from_config(tiny.cfg, seed=s),
             "knockout": lambda s: __import__("mdm_lens.probes.patching", fromlist=["x"]).knockout(
                 tiny, p, gen_length=2, n_steps=2, targets=[0], seed=s),
             "export": lambda s: __import__("mdm_lens.sae", fromlist=["x"]).export_activations(
                 tiny, [[10, 11, 12]], "blocks.0.hook_resid_post", out=tmp_path / "x", seed=s)}
    with pytest.raises(ArgumentError, match="18446744073709551615") as e:
        calls[where](2**70)
    assert e.value.argument == "seed"
    if where == "generate":
        tiny.generate(p, steps=2, gen_length=2, seed=2**64 - 1)  # the largest seed torch takes runs


def test_stacked_mlp_biases_are_read_only_zero_views(tiny):
    from mdm_lens.readonly import ReadOnlyViewError

    n, d, m = tiny.cfg.n_layers, tiny.cfg.d_model, tiny.cfg.d_mlp
    assert tiny.b_in.shape == (n, m) and tiny.b_out.shape == (n, d)
    assert torch.equal(tiny.b_in[1], tiny.blocks[1].mlp.b_in) and not tiny.b_out.any()
    with pytest.raises(ReadOnlyViewError, match="model.b_in"):
        tiny.b_in[0, 0] += 1
    assert tiny.W_gate.shape == (n, d, m)


def test_an_absurd_step_count_is_refused_before_it_exhausts_host_memory(tiny):
    from mdm_lens.errors import MemoryBudgetError

    p = torch.tensor([[10, 11, 12, 13, 14, 15]])
    with pytest.raises(MemoryBudgetError, match="steps=100000000000 would keep"):  # 8 TB: more than any host
        tiny.generate(p, steps=10**11, gen_length=4)


# --- misuse21 ---------------------------------------------------------------------------------------------------

SMALL = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=50, n_ctx=64, mask_token_id=49)


@pytest.mark.parametrize("key, value", [("act_fn", "gelu"), ("attn_only", True), ("attn_only", "yes"),
                                        ("normalization_type", "LN"), ("positional_embedding_type", "standard")])
def test_from_config_refuses_a_tl_field_hookedmdm_never_computes(key, value):
    # accepted and ignored before (identical logits), then refused by from_pretrained of the folder it saved
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{key}={value!r} is invalid: HookedMDM implements"):
        HookedMDM.from_config(MDMConfig(**dict(SMALL, **{key: value})), seed=0)


@pytest.mark.parametrize("dtype", ["float17", "int64", 5, torch.int64, None])
def test_mdmconfig_refuses_a_dtype_it_cannot_compute_in(dtype):
    from mdm_lens import MDMConfig
    from mdm_lens.errors import ConfigError

    with pytest.raises(ConfigError, match="dtype=.* is invalid: expected one of float32, float16, bfloat16, float64"):
        MDMConfig(**dict(SMALL, dtype=dtype))
    for ok, want in (("bfloat16", torch.bfloat16), ("torch.float64", torch.float64), (torch.float16, torch.float16)):
        assert MDMConfig(**dict(SMALL, dtype=ok)).dtype == want


@pytest.mark.parametrize("std", [-1.0, 0.0, float("nan"), float("inf")])
def test_from_config_names_a_bad_init_std(std):
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError) as e:
        HookedMDM.from_config(MDMConfig(**SMALL), seed=0, init_std=std)
    assert e.value.argument == "init_std"


def test_add_hook_refuses_a_hook_that_is_not_callable(tiny):
    from mdm_lens.errors import ArgumentTypeError

    for bad in (None, 5):
        with pytest.raises(ArgumentTypeError, match="expected a function") as e:
            tiny.add_hook("blocks.0.attn.hook_z", bad)
        assert e.value.argument == "hook"
    assert not any(hp.fwd_hooks for hp in tiny.hook_dict.values())
    tiny(torch.tensor([[5, 6, 7]]))


def test_noise_level_labels_rows_with_the_model_layer_and_the_level_value():
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.probes.noise_level import noise_level

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=3, n_heads=2,
                      time_conditioning=True)
    m = HookedDDiT.from_config(cfg, seed=0, init_std=0.2)
    toks = torch.tensor([[3, 5, 7, 9, 39, 39, 11, 39]])
    res = noise_level(m, toks, [0.5, 2.0], layers=[2, 1])
    _, cache = m.run_with_cache(toks, sigma=2.0)
    by_hand = {l: cache[f"blocks.{l}.adaLN.hook_gate_msa"].abs().mean().item() for l in range(3)}
    rows = {(r["sigma"], r["layer"]): r["gate_msa"] for r in res.table()}
    assert set(rows) == {(0.5, 2), (0.5, 1), (2.0, 2), (2.0, 1)}
    for layer in (2, 1):
        assert rows[(2.0, layer)] == pytest.approx(by_hand[layer], rel=1e-5)
    df = res.to_frame()
    gate = df[df.metric == "gate_msa"].set_index(["level", "layer"])["value"]
    assert gate[(2.0, 2)] == pytest.approx(by_hand[2], rel=1e-5) and set(df.level) == {0.5, 2.0}


def test_a_size_error_says_which_config_keys_took_reference_defaults(tmp_path):
    from mdm_lens.errors import ConfigError
    from mdm_lens.loading import read_config

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["SDARForCausalLM"], model_type="sdar", vocab_size=64, hidden_size=32, num_attention_heads=4,
        num_hidden_layers=2, head_dim=8, intermediate_size=64, max_position_embeddings=256, mask_token_id=63)))
    with pytest.raises(ConfigError, match="does not set num_key_value_heads: the reference config class's default was used"):
        read_config(tmp_path, "x", None)


# --- misuse22 ---------------------------------------------------------------------------------------------------

def test_generate_seed_defaults_to_0_and_none_draws_from_torchs_global_generator(tiny):
    p = torch.tensor([[9, 29, 33, 35, 13, 14]])
    a = [tiny.generate(p, gen_length=8, steps=8, temperature=5.0).tokens for _ in range(2)]
    assert torch.equal(a[0], a[1]) and tiny.generate(p, gen_length=8, steps=8).settings.get("seed", 0) == 0
    got = []
    for s in (1, 2, 1):
        torch.manual_seed(s)
        got.append(tiny.generate(p, gen_length=8, steps=8, temperature=5.0, seed=None).tokens)
    assert not torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_the_config_size_note_appears_only_for_a_size_the_error_names(tmp_path):
    from mdm_lens.errors import ConfigError
    from mdm_lens.loading import read_config

    base = dict(architectures=["DreamModel"], model_type="Dream", vocab_size=64, hidden_size=32,
                num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256, num_key_value_heads=2,
                intermediate_size=64, mask_token_id=64)
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(ConfigError) as e:
        read_config(tmp_path, "x", None)
    assert "mask_token_id=64" in str(e.value) and "does not set" not in str(e.value)


def test_export_points_lengths_in_sampler_kwargs_to_its_own_arguments(tiny, tmp_path):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.sae import export_activations

    for key, own in (("gen_length", "gen_length"), ("steps", "n_steps")):
        with pytest.raises(ArgumentError, match=f"export_activations\\({own}=") as e:
            export_activations(tiny, [[5, 6, 7]], "blocks.1.hook_resid_post", out=tmp_path / key,
                               sampler_kwargs={key: 4})
        assert e.value.argument == "sampler_kwargs"


def test_an_empty_names_filter_is_refused_with_its_own_reason(tiny):
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"names_filter=\[\] selects no hook point"):
        tiny.run_with_cache(torch.tensor([[5, 6, 7]]), names_filter=[])


def test_generate_resolves_its_settings_once_so_a_settings_warning_is_said_once(tmp_path):
    # the host-memory check used to resolve the settings a second time, repeating LLaDA2's steps-cap warning
    import warnings

    from tests.test_misuse_round4a import _family

    model = _family("llada2", tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model.generate(torch.tensor([[3, 9, 4, 17, 8]]), gen_length=8, block_length=4, steps=100)
    assert len([x for x in w if "steps=100" in str(x.message)]) == 1
