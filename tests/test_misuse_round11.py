"""Held-out misuse findings, round eleven (misuse22's U4 and the runs after it): each test fails on the code before
its fix."""

from __future__ import annotations

import warnings

import pytest
import torch


@pytest.fixture(scope="module")
def arm():
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-arm")


def test_arm_aligned_stack_is_as_wide_as_the_canvas(arm):
    # ARM's forwards never feed back the token they commit last, so the widest forward is one position short of the
    # canvas; align=True promises canvas-shaped tensors (to sit beside out.tokens and the records' key axis)
    from mdm_lens import ReceivedAttention

    out = arm.generate(torch.tensor([[9, 29, 33, 35, 13, 14]]), gen_length=4, record=[ReceivedAttention()],
                       cache=["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"])
    width = out.tokens.shape[1]
    assert out.records["received_attention"].shape[-1] == width == 10
    resid = out.cache.stack("blocks.0.hook_resid_post", align=True)
    pattern = out.cache.stack("blocks.0.attn.hook_pattern", align=True)
    assert resid.shape == (4, 1, width, arm.cfg.d_model) and pattern.shape[-2:] == (width, width)
    # step s computed positions [0, 6 + s): the rest (the last position at every step) is NaN, the rows are exact
    computed = ~resid[:, 0, :, 0].isnan()
    assert computed.sum(-1).tolist() == [6, 7, 8, 9] and not computed[:, -1].any()
    for s in range(4):
        assert torch.equal(resid[s, :, : 6 + s], out.cache[s]["blocks.0.hook_resid_post"])


def _zoo_items(tmp_path, n=2):
    from mdm_lens.zoo import jsonl

    path = tmp_path / "items.jsonl"
    jsonl.export(path, n, seed=0)
    return path


@pytest.fixture(scope="module")
def dream_zoo():
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.zoo import tokenizer as ZT

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=ZT.vocab_size(), n_ctx=128,
                    mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID, eos_token_id=ZT.EOS_ID,
                    pad_token_id=ZT.PAD_ID, logit_shift=True, family="dream", position_policy="cumsum",
                    padding_mask="pair", extra={"gen_length": 4})
    model = HookedMDM.from_config(cfg, seed=0)
    model.set_tokenizer(ZT.load_tokenizer())
    return model


def test_sweep_refuses_lengths_the_sampler_would_not_receive(tmp_path, dream_zoo, arm):
    # misuse23 S1: the sweep dropped --block-length on Dream-family models and ARMs, and replaced an ARM's explicit
    # --steps by gen_length, while generate refuses both; nothing may be written before the refusal
    from mdm_lens import sweep
    from mdm_lens.errors import SamplerConfigError

    data = _zoo_items(tmp_path)
    cases = [(dream_zoo, dict(block_length=2, steps=4), "block_length", 2),
             (arm, dict(block_length=2), "block_length", 2), (arm, dict(steps=2), "steps", 2)]
    for i, (model, kw, arg, value) in enumerate(cases):
        out = tmp_path / f"s{i}"
        with pytest.raises(SamplerConfigError) as e:
            sweep.run(model, str(data), "accuracy", str(out), limit=1, gen_length=4, progress=False, **kw)
        assert (e.value.argument, e.value.value) == (arg, value) and not out.exists()
    # what they do receive still runs: the ARM's explicit steps equal to gen_length, Dream's steps
    sweep.run(arm, str(data), "accuracy", str(tmp_path / "ok"), limit=1, gen_length=4, steps=4, progress=False)
    sweep.run(dream_zoo, str(data), "accuracy", str(tmp_path / "ok2"), limit=1, gen_length=4, steps=2,
              progress=False)


@pytest.fixture(scope="module")
def tiny():
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_explore_places_a_lens_trace_at_its_answer_positions(tiny):
    # misuse23 S2: lens_trace's top1 is over answer positions and the explorer reads canvas positions, so the trace's
    # tokens were drawn under the prompt; an answer-wide tensor must be refused, the trace itself placed
    from mdm_lens import ReceivedAttention
    from mdm_lens.errors import InputError
    from mdm_lens.lens import lens_trace
    from mdm_lens.views import explore

    prompt = tiny.to_tokens("Q: what is the capital?")
    out = tiny.generate(prompt, steps=4, gen_length=4, record=[ReceivedAttention()])
    trace = lens_trace(tiny, out, layers=[1, 3], steps=[0, 2], positions=[1, 3])
    with pytest.raises(InputError) as e:
        explore(out, tiny, lens_top1=trace.top1[:, :, 0])
    assert e.value.argument == "lens_top1" and "LensTrace" in str(e.value)
    lens = explore(out, tiny, lens_top1=trace).data[0]["lens"]
    P = out.prompt_length
    for i, step in enumerate(trace.steps):
        for j, layer in enumerate(trace.layers):
            shown = lens[step][layer]
            expected = [None] * out.tokens.shape[1]
            for k, pos in enumerate(trace.positions):
                expected[P + pos] = tiny.to_str_tokens(trace.top1[i, j, 0, k].reshape(1))[0]
            assert shown == expected
    assert all(v is None for v in lens[1][1]) and all(v is None for v in lens[0][0])
    other = tiny.generate(prompt[:, 1:], steps=4, gen_length=4)
    with pytest.raises(InputError, match="trace this run"):
        explore(out, tiny, lens_top1=lens_trace(tiny, other))


def test_diffusion_gemma_runs_refuse_replay_with_a_reason():
    # misuse23 C1: state_at / replay / at_step read the settings' mask id, which a DiffusionGemma run has not: a raw
    # KeyError; they must be a typed refusal saying why the steps cannot be rebuilt
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.errors import SamplerConfigError

    model = TransformersBridge(tiny_diffusion_gemma(seed=0))
    prompt = torch.randint(2, model.cfg.d_vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, seed=0, max_new_tokens=16, max_denoising_steps=4)
    def enter_at_step():
        with out.at_step(model, 1):
            pass

    for call in (lambda: out.state_at(1), lambda: out.replay(model, 1), enter_at_step):
        with pytest.raises(SamplerConfigError) as e:
            call()
        assert e.value.argument == "out" and "self-conditioning" in str(e.value)


def test_the_cache_budget_variable_is_read_when_a_cache_is_made(tiny, monkeypatch):
    # misuse23 U1: MDM_LENS_CACHE_BUDGET_GB was read at import, so the remedy the MemoryBudgetError names did
    # nothing in a running notebook; the error must say where its budget came from
    from mdm_lens import steps
    from mdm_lens.errors import ArgumentError, MemoryBudgetError
    from mdm_lens.hooks.trajectory import TrajectoryCache

    prompt = tiny.to_tokens("Q: what is the capital?")
    request = "blocks.*.attn.hook_pattern" @ steps()
    monkeypatch.setenv("MDM_LENS_CACHE_BUDGET_GB", "0.000001")
    with pytest.raises(MemoryBudgetError, match=r"\(MDM_LENS_CACHE_BUDGET_GB=0.000001\)"):
        tiny.generate(prompt, steps=4, gen_length=4, cache=request)
    monkeypatch.setenv("MDM_LENS_CACHE_BUDGET_GB", "1")
    out = tiny.generate(prompt, steps=4, gen_length=4, cache=request)
    assert len(list(out.cache)) == 4 and out.cache.budget_bytes == 2**30
    with pytest.raises(MemoryBudgetError, match=r"\(budget_bytes\)"):     # an explicit budget wins
        tiny.generate(prompt, steps=4, gen_length=4, cache=TrajectoryCache(request.names, budget_bytes=10))
    monkeypatch.delenv("MDM_LENS_CACHE_BUDGET_GB")
    assert TrajectoryCache("blocks.0.hook_resid_post").budget_bytes == 4 * 2**30
    for bad in ("lots", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("MDM_LENS_CACHE_BUDGET_GB", bad)
        with pytest.raises(ArgumentError) as e:
            TrajectoryCache("blocks.0.hook_resid_post")
        assert e.value.argument == "MDM_LENS_CACHE_BUDGET_GB" and e.value.value == bad


def test_from_config_gives_the_model_its_own_config(tiny):
    # misuse24 S1: from_config(m.cfg) kept the caller's object, so process_weights_ on the new model told TL the first
    # (unprocessed) model was folded, and save_pretrained of it wrote a checkpoint its loader refuses
    from mdm_lens import HookedMDM

    before = (tiny.cfg.normalization_type, tiny.cfg.n_params, dict(tiny.cfg.extra))
    twin = HookedMDM.from_config(tiny.cfg, seed=0)
    assert twin.cfg is not tiny.cfg and twin.cfg.extra is not tiny.cfg.extra and twin.cfg == tiny.cfg
    twin.process_weights_()
    twin.cfg.extra["expand_token_id"] = 3
    assert (tiny.cfg.normalization_type, tiny.cfg.n_params, dict(tiny.cfg.extra)) == before
    assert twin.cfg.normalization_type == "RMSPre"


def _rnd1(folder):
    import sys
    from pathlib import Path

    from mdm_lens import HookedMDM

    sys.path.insert(0, str(Path(__file__).parent / "families"))  # the family writers import each other by name
    from rnd1_coda_checkpoints import write_rnd1

    path, _, _ = write_rnd1(folder / "rnd1")
    return HookedMDM.from_pretrained(str(path))


def test_rnd1_warns_of_the_steps_its_schedule_leaves_idle(tmp_path):
    # misuse24 S2: RND1's plan is adaptive, so the idle-step warning was skipped; its entropy schedule says in advance
    # which steps commit nothing (gen_length 4: 3 maskable slots; 8 steps keep 2,2,1,1,1,0 masked)
    from mdm_lens import IdleStepsWarning

    model = _rnd1(tmp_path)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with pytest.warns(IdleStepsWarning, match=r"steps \[1, 3, 4\] commit no token"):
        out = model.generate(prompt, gen_length=4, steps=8, seed=0)
    assert out.trajectory.n_committed[:, 0].tolist() == [1, 0, 1, 0, 0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleStepsWarning)
        model.generate(prompt, gen_length=4, steps=4, seed=0)            # no idle step: no warning
        model.generate(prompt, gen_length=4, steps=8, seed=0, eb_gamma=0.5)  # commits at least one per step


def test_a_variable_length_run_that_changed_nothing_is_refused_without_claiming_it_did():
    # misuse24 U1: the refusal said "this run inserted and deleted rows" of a DreamOn run that did neither
    from mdm_lens.diffusion.fixed_length import require_fixed_length
    from mdm_lens.errors import SamplerConfigError
    from test_dreamon import PREFIX, SUFFIX, dreamon_model

    model = dreamon_model(boost=0.0, expand_boost=0.0)       # EOS and expand never win: no deletion, no expansion
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=8, min_gen_len=4, max_gen_len=8, seed=0)
    trace = out.trajectory.length
    assert trace.n_slots == trace.n_original and not bool((trace.removed_how != 0).any())
    with pytest.raises(SamplerConfigError) as e:
        require_fixed_length(out, "probe X")
    assert "inserted and deleted rows mid-run" not in str(e.value)
    assert f"width {trace.n_original} throughout" in str(e.value) and e.value.argument == "out"
    changing = dreamon_model().generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3,
                                        max_gen_len=10, seed=0)
    with pytest.raises(SamplerConfigError, match=r"inserted and deleted rows mid-run \(canvas widths \["):
        require_fixed_length(changing, "probe X")


def test_nnsight_layer_index_out_of_range_names_the_range(tiny):
    # misuse24 U2: nnsight resolves lm.blocks[9] by attribute name: "'PhasedEnvoy' object has no attribute '9'"
    pytest.importorskip("nnsight")
    from mdm_lens.errors import OutOfRangeError
    from mdm_lens.nnsight import DiffusionLM

    lm = DiffusionLM(tiny)
    for bad in (4, 9, -5):
        with pytest.raises(OutOfRangeError) as e:
            lm.blocks[bad]
        assert e.value.argument == "blocks" and e.value.value == bad and "[-4, 3]" in str(e.value)
    assert lm.blocks[-1].path == lm.blocks[3].path and len(lm.blocks[1:3]) == 2
    prompt = tiny.to_tokens("Q: what is the capital?")
    with lm.generate(prompt, steps=4, gen_length=4) as tracer:
        for _ in tracer.iter[1]:
            saved = lm.blocks[-1].hook_resid_post.output.save()
    out = tiny.generate(prompt, steps=4, gen_length=4, cache="blocks.3.hook_resid_post")
    assert torch.allclose(saved, out.cache[1]["blocks.3.hook_resid_post"], atol=1e-5)


def test_sweep_of_a_checkpoint_without_tokenizer_says_what_the_folder_needs(tmp_path, tiny, capsys):
    # misuse24 U3: the sweep's only advice was the Python API's (pass token ids, set_tokenizer), which the command
    # line cannot follow; nothing may be written
    from mdm_lens import HookedMDM, sweep
    from mdm_lens.errors import InputError
    from mdm_lens.loading import save_pretrained
    from mdm_lens.sweep.__main__ import main

    save_pretrained(tiny, tmp_path / "ck")
    (tmp_path / "ck" / "tokenizer.json").unlink()
    assert HookedMDM.from_pretrained(str(tmp_path / "ck")).tokenizer is None
    data = _zoo_items(tmp_path)
    code = main(["--model", str(tmp_path / "ck"), "--data", str(data), "--probes", "accuracy", "--out",
                 str(tmp_path / "out"), "--limit", "1"])
    assert code == 2 and "tokenizer.json beside config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError) as e:
        sweep.run(str(tmp_path / "ck"), str(data), "accuracy", str(tmp_path / "out"), limit=1, progress=False)
    assert e.value.argument == "model"


def test_kv_age_record_names_its_own_axes(tiny):
    # misuse25 S2: kv_norms' meta said ("step", "batch", "layer", "kv_head", "pos") for its [step, pos] kv_age too
    from mdm_lens import KeyValueNorms

    prompt = tiny.to_tokens("ctx: paris is the capital. q: capital? a:")
    out = tiny.generate(prompt, gen_length=8, block_length=4, steps=8, kv_cache="prefix", record=[KeyValueNorms()])
    age, meta = out.records["kv_age"], out.record_meta
    assert meta["kv_age"]["axes"] == ("step", "pos") and age.ndim == 2
    assert meta["key_norms"]["axes"] == ("step", "batch", "layer", "kv_head", "pos") == meta["value_norms"]["axes"]
    assert out.records["key_norms"].ndim == 5 and "record_axes" not in meta["kv_age"]
    assert "('step', 'pos')" in repr(out)


def test_to_dtype_updates_the_config_that_repr_and_save_read(tmp_path):
    # misuse25 S4: model.to(torch.float32) left cfg.dtype bfloat16, so repr and the saved config.json named a
    # dtype the weights do not have (TL's move_to_and_update_config updates it)
    import json

    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.loading import save_pretrained

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=50, n_ctx=64, mask_token_id=49,
                    dtype=torch.bfloat16, family="llada")
    model = HookedMDM.from_config(cfg, seed=0)
    assert model.to(torch.float32) is model and model.cfg.dtype == torch.float32 and cfg.dtype == torch.bfloat16
    assert "bfloat16" not in repr(model)
    save_pretrained(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float32"
    for convert, want in ((model.half, torch.float16), (model.bfloat16, torch.bfloat16),
                          (model.double, torch.float64), (model.float, torch.float32)):
        convert()
        assert model.cfg.dtype == want == model.W_E.dtype
    model.to("cpu")                                          # a device alone leaves the dtype
    assert model.cfg.dtype == torch.float32


def test_fastdllm_v2_refuses_a_pad_id_equal_to_the_mask_id():
    # misuse25 S7: pad_id = mask id filled the tail after the stop token with mask ids counted as committed
    from mdm_lens.errors import SamplerConfigError
    from test_fastdllm_v2 import planted_model

    model = planted_model()
    with pytest.raises(SamplerConfigError) as e:
        model.generate([[20, 21]], sampler="fastdllm_v2", block_size=4, small_block_size=4, max_new_tokens=8,
                       stop_token=1, pad_id=49)
    assert e.value.argument == "pad_id" and e.value.value == 49


def test_noise_level_names_the_bad_level_not_the_forwards_sigma():
    # misuse25 U2: a negative or NaN level was refused by the forward as `sigma=`, an argument the caller never saw
    import math

    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.noise_level import noise_level

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=True)
    m = HookedDDiT.from_config(cfg, seed=0)
    toks = torch.tensor([[3, 5, 7, 9, cfg.mask_token_id, cfg.mask_token_id]])
    for levels, name in (([0.5, -1.0], "levels[1]"), ([math.nan], "levels[0]"), ([math.inf, 1.0], "levels[0]")):
        with pytest.raises(ArgumentError) as e:
            noise_level(m, toks, levels=levels)
        assert e.value.argument == name
    assert noise_level(m, toks, levels=[0.0, 3.0]).anchor_share.shape[0] == 2


def test_bridge_refuses_tl_weight_views_with_the_reason():
    # misuse25 U3: model.OV on the bridge was a bare AttributeError; hasattr / getattr(default) keep working
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.errors import UnsupportedAttributeError

    model = TransformersBridge(tiny_diffusion_gemma(seed=0))
    for name in ("OV", "QK", "W_Q", "W_in", "set_use_attn_result"):
        with pytest.raises(UnsupportedAttributeError, match="transformers-native bridge") as e:
            getattr(model, name)
        assert e.value.argument == name
        assert not hasattr(model, name) and getattr(model, name, 7) == 7
    with pytest.raises(AttributeError) as e:
        model.no_such_thing
    assert not isinstance(e.value, UnsupportedAttributeError)
    assert model.W_E.shape[0] == model.cfg.d_vocab


def test_anchor_readers_refuse_a_cumulative_record(tiny):
    # misuse26 S1: the anchor rules' thresholds are shares of a unit mass; a cumulative record (column sums, here
    # ~30x larger) made gu find an anchor at every step
    from mdm_lens import ReceivedAttention
    from mdm_lens.errors import InputError
    from mdm_lens.probes import run as R

    prompt = tiny.to_tokens("ctx: paris is the capital. q: capital? a:")
    out = tiny.generate(prompt, steps=4, gen_length=4,
                        record=[ReceivedAttention(), ReceivedAttention(kind="cumulative", name="cum")])
    for reader in (R.anchors_over_steps, R.drift_from_output):
        with pytest.raises(InputError) as e:
            reader(out, layer=0, record="cum")
        assert e.value.argument == "record" and e.value.value == "cum" and "'cumulative'" in str(e.value)
        reader(out, layer=0)                                      # the mass record still reads


def test_explore_refuses_a_lens_trace_of_another_run(tiny, arm):
    # misuse26 S2: only the step count and prompt length were compared, so another run's trace (even an MDM's on
    # an ARM run) was drawn as this run's
    from mdm_lens.errors import InputError
    from mdm_lens.lens import lens_trace
    from mdm_lens.views import explore

    prompt = tiny.to_tokens("Q: what is the capital?")
    out = tiny.generate(prompt, steps=4, gen_length=4, seed=0)
    trace = lens_trace(tiny, out)
    explore(out, tiny, lens_top1=trace)
    other = tiny.generate(prompt, steps=4, gen_length=4, seed=0, temperature=1.0)
    assert not torch.equal(other.tokens, out.tokens)
    for run, model in ((other, tiny), (arm.generate(prompt, gen_length=4), arm)):
        with pytest.raises(InputError, match="another run") as e:
            explore(run, model, lens_top1=trace)
        assert e.value.argument == "lens_top1"


def test_a_block_causal_model_without_a_block_length_says_its_forward_is_bidirectional():
    # misuse26 S4: the plain forward attended bidirectionally while the block samplers used their reference default
    from mdm_lens import HookedMDM, MDMConfig

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=50, mask_token_id=49, n_ctx=64,
                    attention="block_causal")
    model = HookedMDM.from_config(cfg, seed=0)
    x = torch.randint(0, 49, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"attends bidirectionally"):
        model(x)
    model.cfg.extra["block_length"] = 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blocked = model(x)
    assert torch.allclose(blocked, model(x, block_length=4))


def test_explorer_save_wants_an_html_name(tiny, tmp_path):
    # misuse26 S6: the page was written as HTML under any name, e.g. x.png
    from mdm_lens.errors import ArgumentError
    from mdm_lens.views import explore

    page = explore(tiny.generate(tiny.to_tokens("Q: what is the capital?"), steps=2, gen_length=2), tiny)
    with pytest.raises(ArgumentError) as e:
        page.save(tmp_path / "x.png")
    assert e.value.argument == "path" and not (tmp_path / "x.png").exists()
    assert page.save(tmp_path / "x.HTML").read_text().startswith("<!doctype html>")


def test_a_model_cannot_be_moved_to_meta_and_extra_must_be_a_dict():
    # misuse26 C1 / C2: .to("meta") was accepted and the next forward died inside torch; MDMConfig(extra=[1]) was
    # accepted and from_config died with "'list' object has no attribute 'get'"
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.errors import ArgumentError, ConfigError

    base = dict(d_model=32, n_layers=1, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49)
    model = HookedMDM.from_config(MDMConfig(**base), seed=0)
    for target in ("meta", torch.device("meta")):
        with pytest.raises(ArgumentError) as e:
            model.to(target)
        assert e.value.argument == "device"
    assert model.W_E.device.type == "cpu"
    for extra in ([1], "abc", None):
        with pytest.raises(ConfigError, match="extra="):
            MDMConfig(**base, extra=extra)


def test_length_keyword_refusal_points_to_the_step_selector(tiny):
    # misuse26 U1: patch_anchor_activations(steps=[0]) was pointed to n_steps= only, never to its step=
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import patching as PT

    ids = tiny.to_tokens("ctx: paris is the capital. q: capital? a:")
    with pytest.raises(ArgumentError, match=r"step= where it acts at one step") as e:
        PT.patch_anchor_activations(tiny, ids, ids.flip(1), steps=[0])
    assert e.value.argument == "steps"


def test_sigma_patch_names_the_wrong_model_before_its_conditioning():
    # misuse26 U3: another model's run was blamed on that model's time conditioning
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.errors import InputError
    from mdm_lens.probes.conditioning import sigma_patch

    small = dict(d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2)
    ran = HookedDDiT.from_config(ddit_config("mdlm", **small, time_conditioning=True), seed=0)
    other = HookedDDiT.from_config(ddit_config("mdlm", **dict(small, n_layers=1), time_conditioning=False), seed=1)
    out = ran.generate(torch.tensor([[3, 5, 7]]), gen_length=4, steps=4, seed=0)
    with pytest.raises(InputError, match="not by the model given") as e:
        sigma_patch(other, out, 1, 3)
    assert e.value.argument == "out"
    assert sigma_patch(ran, out, 1, 3).shape[-1] == 40


def test_anchor_readers_take_only_a_mass_record_and_name_their_axes(tiny):
    # misuse27 S2 / S3 / U2: a KeyValueNorms record was read as attention mass; drift's table named its axes
    # dim0 / dim1; a tensor given as the run was blamed on a missing record
    from mdm_lens import KeyValueNorms, ReceivedAttention
    from mdm_lens.errors import ArgumentTypeError, InputError
    from mdm_lens.probes.run import anchors_over_steps, drift_from_output

    prompt = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    out = tiny.generate(prompt, attention_mask=mask, steps=4, gen_length=4,
                        record=[ReceivedAttention(), KeyValueNorms()])
    for reader in (anchors_over_steps, drift_from_output):
        with pytest.raises(InputError, match="not a ReceivedAttention record") as e:
            reader(out, layer=0, record="key_norms")
        assert e.value.argument == "record"
        with pytest.raises(ArgumentTypeError) as e:
            reader(torch.zeros(3), layer=0)
        assert e.value.argument == "out"
    frame = drift_from_output(out, layer=0, head="each").to_frame()
    assert {"batch", "head"} <= set(frame.columns) and not any(c.startswith("dim") for c in frame.columns)
    assert "batch" in drift_from_output(out, layer=0).to_frame().columns


def test_bridge_cache_refuses_the_tl_helpers_its_math_does_not_hold_for():
    # misuse27 S1 / C1: on DiffusionGemma decompose_resid's parts missed the per-layer scalar (off by ~5), and the
    # helpers needing W_O / token directions crashed with raw AttributeError / NotImplementedError
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.errors import ArgumentError

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0))
    prompt = torch.randint(2, bridge.cfg.d_vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    canvas = torch.randint(0, bridge.cfg.d_vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    _, cache = bridge.run_with_cache(prompt, decoder_input_ids=canvas)
    calls = {"decompose_resid": lambda: cache.decompose_resid(layer=-1),
             "logit_attrs": lambda: cache.logit_attrs(cache.accumulated_resid(pos_slice=-1), tokens=5, pos_slice=-1),
             "accumulated_resid": lambda: cache.accumulated_resid(apply_ln=True),
             "stack_head_results": lambda: cache.stack_head_results(layer=-1),
             "get_full_resid_decomposition": lambda: cache.get_full_resid_decomposition()}
    for helper, call in calls.items():
        with pytest.raises(ArgumentError, match="not defined for a TransformersBridge cache") as e:
            call()
        assert e.value.argument == helper
    resid = cache.accumulated_resid()                     # the residual hooks themselves still read
    assert torch.equal(resid[-1], cache[f"blocks.{bridge.cfg.n_layers - 1}.hook_resid_post"])


def test_a_glob_skips_per_head_results_while_they_are_off(tiny):
    # misuse27 U1: "blocks.0.attn.*" in generate matched hook_result and failed after earlier steps had run, while
    # the same glob works in run_with_cache; an explicit hook_result is still refused with what to call
    from mdm_lens import steps
    from mdm_lens.errors import HookNameError

    prompt = torch.randint(4, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    out = tiny.generate(prompt, steps=4, gen_length=4, cache="blocks.0.attn.*" @ steps(2))
    assert "blocks.0.attn.hook_pattern" in out.cache[2] and "blocks.0.attn.hook_result" not in out.cache[2]
    tiny.generate(prompt, steps=4, gen_length=4, fwd_hooks=[("blocks.0.attn.*", lambda x, hook: None)])
    with pytest.raises(HookNameError, match="set_use_attn_result"):
        tiny.generate(prompt, steps=4, gen_length=4, cache="blocks.0.attn.hook_result")


def test_ablation_refuses_another_models_retrieval_heads(tiny, arm):
    # misuse27 S4: the MDM's "top" condition ablated heads ranked on the ARM twin, with no check or note
    from mdm_lens.errors import InputError
    from mdm_lens.probes.ablation import ablation_accuracy
    from mdm_lens.probes.retrieval import retrieval_scores
    from mdm_lens.zoo import data as D

    items = D.make_dataset(2, seed=1, n_distractors=2)
    theirs = retrieval_scores(arm, items)
    assert theirs.model_key[0] == arm.cfg.model_name
    with pytest.raises(InputError) as e:
        ablation_accuracy(tiny, items, theirs, k=2)
    assert e.value.argument == "heads"


def test_logit_attrs_names_has_batch_dim_when_it_drops_the_axis(tiny):
    # misuse27 U3: TL's has_batch_dim=False was refused by a slicing message that never named it
    from mdm_lens.errors import ArgumentError

    _, cache = tiny.run_with_cache(tiny.to_tokens("Q: what is the capital?"))
    stack = cache.accumulated_resid(pos_slice=-1)
    with pytest.raises(ArgumentError) as e:
        cache.logit_attrs(stack[:, 0], tokens=7, pos_slice=-1, has_batch_dim=False)
    assert e.value.argument == "has_batch_dim"
    assert cache.logit_attrs(stack, tokens=7, pos_slice=-1).shape == (stack.shape[0], 1)
