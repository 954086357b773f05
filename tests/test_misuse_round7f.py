"""Held-out misuse, round seven (f): knockout's step grid is the clean run's forwards on adaptive samplers."""

from __future__ import annotations

import re

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import OutOfRangeError
from mdm_lens.probes.knockout import knockout
from tests.families.family_checkpoints import write_llada2, write_sdar

PROMPT = torch.tensor([[5, 17, 33, 2, 61]])


@pytest.fixture(scope="module", params=["llada2", "sdar"])
def block_model(request, tmp_path_factory):
    write = write_llada2 if request.param == "llada2" else write_sdar
    folder = write(tmp_path_factory.mktemp(request.param))[0]
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_knockout_steps_are_the_clean_runs_forwards(block_model):
    n = block_model.generate(PROMPT, gen_length=8, block_length=4).n_steps
    assert n > 8  # adaptive: more forwards than gen_length (the old grid)
    assert knockout(block_model, PROMPT, gen_length=8, block_length=4, steps=["last"], targets=[0]).steps == [n - 1]
    assert knockout(block_model, PROMPT, gen_length=8, block_length=4, steps=[-2], targets=[0]).steps == [n - 2]
    full = knockout(block_model, PROMPT, gen_length=8, block_length=4, targets=[0])
    assert full.steps == list(range(n)) and full.tf_answer_logprob.shape == (3, n)  # clean, targets, random
    with pytest.raises(OutOfRangeError, match=f"forward of the clean run \\({n} made\\)"):
        knockout(block_model, PROMPT, gen_length=8, block_length=4, steps=[n], targets=[0])


def test_sdar_stop_sets_the_answer_span_up_to_the_first_stop_token(tmp_path):
    model = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "sdar")[0]), load_tokenizer=False)
    free = model.generate(PROMPT, gen_length=12, block_length=4)
    assert free.answer_length is None  # no stop rule: the whole gen_length
    stop = int(free.tokens[0, 7])  # the third answer token, decoded in the first generated block
    first = int((free.tokens[0, 5:] == stop).nonzero()[0, 0])
    out = model.generate(PROMPT, gen_length=12, block_length=4, stopping_criteria_idx=stop)
    assert out.answer_length == [first + 1]  # up to and including the stop token
    assert torch.equal(out.tokens[0, :8], free.tokens[0, :8])  # the first block is the same run
    assert bool((out.tokens[0, 8:] == model.cfg.mask_token_id).all())  # later blocks never ran


def test_fastdllm_v2_warns_when_max_new_tokens_is_floored_to_whole_blocks(tmp_path):
    import warnings

    from mdm_lens.diffusion.arguments import ReferenceQuirkWarning
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    folder, *_ = write_fastdllm_v2(tmp_path / "fd2")  # bd_size 4
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    kw = dict(small_block_size=2, stop_token=5, pad_id=0)
    with pytest.warns(ReferenceQuirkWarning, match="max_new_tokens=7 is not a multiple of block_size=4.*last 3"):
        short = model.generate(PROMPT, max_new_tokens=7, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuirkWarning)
        whole = model.generate(PROMPT, max_new_tokens=4, **kw)
    assert torch.equal(short.tokens, whole.tokens)  # 7 budgets the same block as 4: the reference's arithmetic


def test_sampler_window_forwards_do_not_run_the_left_pad_heuristic(tmp_path):
    import warnings

    from tests.test_fastdllm_v2 import write_fastdllm_v2

    folder, *_ = write_fastdllm_v2(tmp_path / "fd2")  # bd_size 4
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    prompt = torch.tensor([[5, 17, 33, 2, 61, 40, 9, 12, 44, 3]])
    kw = dict(max_new_tokens=12, small_block_size=2, stop_token=5, pad_id=0)
    first = model.generate(prompt, **kw)
    model.cfg.pad_token_id = int(first.tokens[0, 12])  # a generated token at a block start: a window's first token
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = model.generate(prompt, **kw)
    assert torch.equal(again.tokens, first.tokens)
    assert not [w for w in seen if "start with the pad id" in str(w.message)]
    with pytest.warns(UserWarning, match="start with the pad id"):  # the user's own forward still warns
        model(torch.cat([torch.tensor([[model.cfg.pad_token_id]]), prompt], 1))


def test_memory_plan_takes_generates_attention_mask_and_its_checks():
    from mdm_lens.errors import ArgumentTypeError, InputError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    p = torch.tensor([[0, 5, 7, 9], [1, 5, 7, 9]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    plan = model.memory_plan(p, attention_mask=left, gen_length=8, steps=8)
    assert plan.rows["cpu"].activations > 0
    model.generate(p, attention_mask=left, gen_length=8, steps=8)  # the run it plans
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(InputError) as plan_err:
        model.memory_plan(p, attention_mask=right, gen_length=8, steps=8)
    with pytest.raises(InputError) as gen_err:
        model.generate(p, attention_mask=right, gen_length=8, steps=8)
    assert str(plan_err.value) == str(gen_err.value)
    with pytest.raises(ArgumentTypeError, match="pass prompt"):
        model.memory_plan(prompt_length=4, attention_mask=left, gen_length=8, steps=8)


def test_a_step_selector_whose_parts_never_meet_is_refused_before_compute():
    from mdm_lens import steps
    from mdm_lens.errors import SamplerConfigError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    ids = model.to_tokens("The capital is")
    with pytest.raises(SamplerConfigError, match=r"steps \[1\] are not on every=2's grid \[0, 2, 4, 6, 7\]"):
        model.generate(ids, steps=8, gen_length=8, cache="blocks.0.hook_resid_post" @ steps(1, every=2))
    out = model.generate(ids, steps=8, gen_length=8, cache="blocks.0.hook_resid_post" @ steps(2, 7, every=2))
    assert out.cache.steps == [2, 7]  # on the grid (the last step always is)


def test_loading_on_meta_is_refused():
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match="'meta' model holds shapes but no weight values") as err:
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device="meta")
    assert err.value.argument == "device"


def test_no_processing_honours_explicit_flags_as_transformer_lens_does():
    # TL's from_pretrained_no_processing only changes the flags' defaults to False; an explicit True is honoured
    folded = HookedMDM.from_pretrained_no_processing("mdm-lens/tiny-mdm", fold_ln=True)
    assert folded.blocks[0].ln1.w is None and folded.cfg.normalization_type == "RMSPre"
    plain = HookedMDM.from_pretrained_no_processing("mdm-lens/tiny-mdm")
    assert plain.blocks[0].ln1.w is not None  # unprocessed by default: the norm weight is there


def test_cache_effect_patch_must_be_a_bool():
    from mdm_lens.errors import ArgumentTypeError
    from mdm_lens.probes.cache_effect import cache_effect

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    out = model.generate(model.to_tokens("The capital is"), gen_length=4, steps=4, block_length=2, kv_cache="dual")
    with pytest.raises(ArgumentTypeError) as err:
        cache_effect(model, out, patch="no")
    assert err.value.argument == "patch"


def test_a_word_the_tokenizer_cannot_spell_is_not_read_as_unk():
    from mdm_lens.errors import InputError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    unk = model.to_single_token("<unk>")  # the unknown token named as itself is fine
    word = model.to_string([int(model.to_tokens("capital")[0, -1])]).strip()
    assert model.to_single_token(word) != unk
    for call in (lambda: model.to_single_token("qqqzzz"), lambda: model.tokens_to_residual_directions("qqqzzz")):
        with pytest.raises(InputError, match="tokenizes to the unknown token"):
            call()


def test_memory_plan_refuses_shape_arguments_that_disagree_with_the_prompt():
    from mdm_lens.errors import ArgumentError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    p = torch.tensor([[6, 5, 7, 9]])
    for kw in (dict(prompt_length=10), dict(batch=8)):
        with pytest.raises(ArgumentError, match="disagrees with the prompt's") as err:
            model.memory_plan(p, gen_length=8, steps=8, **kw)
        assert err.value.argument == next(iter(kw))
    same = model.memory_plan(p, prompt_length=4, batch=1, gen_length=8, steps=8)
    assert same.rows["cpu"].activations == model.memory_plan(p, gen_length=8, steps=8).rows["cpu"].activations


@pytest.mark.parametrize("ids", [[999], [-1], [5, 999]])
def test_decoding_ids_outside_the_vocabulary_is_refused(ids):
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    for call in (model.to_string, model.to_str_tokens):
        with pytest.raises(OutOfRangeError, match=f"token ids must lie in \\[0, {model.cfg.d_vocab}\\)"):
            call(torch.tensor(ids))
    assert model.to_string(torch.tensor([5])) == model.to_string([5])  # in range: decoded


def test_indexing_weight_views_past_their_axes_is_typed():
    from mdm_lens.errors import InputTypeError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    n = model.cfg.n_layers
    for call in (lambda: model.OV[n], lambda: model.OV[0, model.cfg.n_heads], lambda: model.W_Q[n],
                 lambda: model.QK[-n - 1]):
        with pytest.raises(OutOfRangeError, match="out of range for a weight view"):
            call()
    with pytest.raises(InputTypeError, match="not a tensor index"):
        model.OV["a"]
    assert torch.equal(model.OV[n - 1, 0].AB, model.OV[-1, 0].AB)  # in range: unchanged


def test_probe_and_lens_argument_types_are_checked_up_front(tmp_path):
    from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputTypeError, SamplerConfigError
    from mdm_lens.probes.retrieval import retrieval_scores
    from mdm_lens.sae.canvas import MaskedCanvas

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    ids = model.to_tokens("The capital is")
    with pytest.raises(ArgumentTypeError, match="decode=5 must be a callable"):
        knockout(model, ids, steps=[0], decode=5, gen_length=4, n_steps=4)
    with pytest.raises(ArgumentTypeError, match="decode"):
        retrieval_scores(model, [object()], decode=5)
    with pytest.raises(InputTypeError, match="tokenize first") as err:
        knockout(model, "The capital is", steps=[0], gen_length=4, n_steps=4)
    assert err.value.argument == "prompt_ids"
    with pytest.raises(ArgumentError, match="eps=0.2 has no effect with mask_rate=0.5"):
        MaskedCanvas(model, mask_rate=0.5, eps=0.2)
    MaskedCanvas(model, eps=0.2)  # LLaDA's rate: eps acts


def test_fastdllm_v2_top_p_is_refused_where_greedy_decoding_ignores_it(tmp_path):
    from mdm_lens.errors import SamplerConfigError
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    folder, *_ = write_fastdllm_v2(tmp_path / "fd2")
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    kw = dict(max_new_tokens=4, small_block_size=2, stop_token=5, pad_id=0)
    with pytest.raises(SamplerConfigError, match="top_p=0.01 has no effect.*temperature > 0"):
        model.generate(PROMPT, top_p=0.01, **kw)
    model.generate(PROMPT, top_p=0.5, temperature=0.7, seed=0, **kw)  # sampling: top_p acts


def test_lens_save_onto_a_file_and_steer_as_a_list_are_typed(tmp_path):
    from mdm_lens.errors import ArgumentError, ArgumentTypeError
    from mdm_lens.lens.tuned import TunedLens
    lens = TunedLens(3, 2, layers=[1])
    target = tmp_path / "lensfile"
    target.write_text("")
    with pytest.raises(ArgumentError, match="is a file, not a folder"):
        lens.save(target)
    assert lens.save(tmp_path / "lens").is_dir()


def test_sae_steer_must_be_a_dict():
    pytest.importorskip("sae_lens")
    from mdm_lens.errors import ArgumentTypeError
    from mdm_lens.sae.splice import sae_hook
    from tests.test_sae import identity_sae

    with pytest.raises(ArgumentTypeError, match="must be a dict"):
        sae_hook(identity_sae(8), "blocks.0.hook_resid_post", steer=[1, 2])


def test_ddit_sigma_errors_name_numbers_and_numpy_scalars_work(tmp_path):
    import numpy as np

    from mdm_lens.errors import ArgumentTypeError
    from tests.families.bd3gidd_checkpoints import write_gidd

    model = HookedMDM.from_pretrained(str(write_gidd(tmp_path / "gidd")[0]), load_tokenizer=False)
    x = torch.tensor([[1, 2, 3, 4]])
    for bad in ([0.5], "0.5"):
        with pytest.raises(ArgumentTypeError, match="expected a number or a float tensor"):
            model(x, sigma=bad)
    assert torch.equal(model(x, sigma=np.float32(0.5)), model(x, sigma=0.5))


def test_run_with_cache_checks_pos_slice_and_device():
    from mdm_lens.errors import ArgumentError, ArgumentTypeError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    ids = model.to_tokens("The capital of France is")
    n = ids.shape[1]
    for bad in (99, (2, 99), [0, n]):
        with pytest.raises(OutOfRangeError):
            model.run_with_cache(ids, pos_slice=bad)
    with pytest.raises(ArgumentTypeError):
        model.run_with_cache(ids, pos_slice=1.5)
    with pytest.raises((ArgumentError, ArgumentTypeError)):
        model.run_with_cache(ids, device="foo")
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="CUDA is not available"):
            model.run_with_cache(ids, device="cuda")
    _, cache = model.run_with_cache(ids, pos_slice=(1, 3))
    assert cache["blocks.0.hook_resid_post"].shape[1] == 2  # in range: TL's slice


def test_attribution_on_a_finished_run_refuses_generation_settings():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import attribution as AT

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    out = model.generate(model.to_tokens("The capital is"), gen_length=3, steps=3)
    for kw in (dict(gen_length=8), dict(n_steps=2), dict(temperature=0.5), dict(bogus=1)):
        with pytest.raises(ArgumentError, match="ignored when out_or_clean is a finished run"):
            AT.attribution_patching(model, out, "knockout", steps=[0], **kw)
    assert AT.attribution_patching(model, out, "knockout", steps=[0]) is not None


def test_probe_grid_refuses_the_other_probes_settings():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.lens.linear import probe_grid

    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 3, 12, 4, generator=g)  # [layer, step, item, d]
    labels = torch.arange(12) % 2
    values = torch.randn(12, generator=g)
    with pytest.raises(ArgumentError, match="l2=50.0 is ignored with probe='ridge'"):
        probe_grid(feats, values, probe="ridge", l2=50.0)
    with pytest.raises(ArgumentError, match="max_iter=3 is ignored with probe='ridge'"):
        probe_grid(feats, values, probe="ridge", max_iter=3)
    with pytest.raises(ArgumentError, match="alpha=50.0 is ignored with probe='logistic'"):
        probe_grid(feats, labels, alpha=50.0)
    assert len(probe_grid(feats, values, probe="ridge", alpha=5.0, n_boot=0))


def test_report_names_a_table_the_manifest_lists_but_the_folder_lacks(tmp_path):
    from mdm_lens import sweep
    from mdm_lens.views.sweep_report import report
    from mdm_lens.zoo import jsonl

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 2, seed=0)
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    sweep.run(model, data, "absorption,accuracy", tmp_path / "sw", progress=False)
    (tmp_path / "sw" / "absorption.parquet").unlink()
    html = report(tmp_path / "sw", tmp_path / "rep").read_text()
    assert "absorption.parquet (listed in the manifest, not in the folder)" in html  # the header's "left out"
    assert "absorption.parquet is missing from its sweep folder(s)" in html          # the section says why


def test_stack_and_cache_positions_must_agree_in_ln_and_attributions():
    from mdm_lens.errors import ArgumentError

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    ids = model.to_tokens("The capital of France is")
    _, cache = model.run_with_cache(ids)
    last = cache.accumulated_resid(layer=-1, pos_slice=-1)  # [components, batch, d_model]
    full = cache.accumulated_resid(layer=-1)                # [components, batch, pos, d_model]
    for call in (lambda: cache.apply_ln_to_stack(last, layer=-1), lambda: cache.logit_attrs(last, tokens=5),
                 lambda: cache.logit_attrs(full, tokens=5, pos_slice=-1),
                 lambda: cache.apply_ln_to_stack(torch.randn(2, 3, ids.shape[1], model.cfg.d_model), layer=-1)):
        with pytest.raises(ArgumentError, match=r"\[batch, pos\] axes"):
            call()
    # matched: the last position's attributions equal the full stack's last column
    a = cache.logit_attrs(last, tokens=5, pos_slice=-1)
    b = cache.logit_attrs(full, tokens=5)[..., -1]
    assert torch.allclose(a, b, atol=1e-5)


def test_cache_effect_names_the_window_steps_when_asked_for_a_refresh_step():
    from mdm_lens.errors import InputError
    from mdm_lens.probes.cache_effect import _windows, cache_effect

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    out = model.generate(model.to_tokens("The capital is"), gen_length=4, steps=4, block_length=2, kv_cache="dual")
    windows = sorted(w[0] for w in _windows(out))
    assert 0 not in windows  # step 0 refreshes the cache
    with pytest.raises(InputError, match=re.escape("steps [0] are the cache's refresh forwards")) as err:
        cache_effect(model, out, steps=[0])
    assert str(err.value).endswith(f"the window steps that read the cache are {windows}.")
    assert len(cache_effect(model, out, steps=windows[:1]).to_frame())


def test_stack_activation_names_the_layer_bound_passed():
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    _, cache = model.run_with_cache(model.to_tokens("The capital is"))
    n = model.cfg.n_layers
    with pytest.raises(OutOfRangeError, match=f"stack_activation\\(layer={n + 5}\\)") as err:
        cache.stack_activation("pattern", layer=n + 5)
    assert err.value.argument == "layer"
    assert cache.stack_activation("pattern", layer=2).shape[0] == 2
    assert cache.stack_activation("pattern").shape[0] == n


def test_features_from_cache_explains_that_hook_is_the_suffix():
    from mdm_lens.errors import InputError
    from mdm_lens.lens.linear import features_from_cache

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    out = model.generate(model.to_tokens("The capital is"), gen_length=4, steps=4, cache="blocks.*.hook_resid_post")
    with pytest.raises(InputError, match=r"hook= is the per-layer suffix \('hook_resid_post'\); choose layers with "
                                         r"layers=\[0\]"):
        features_from_cache(out.cache, hook="blocks.0.hook_resid_post")
    assert features_from_cache(out.cache, layers=[0]) is not None


@pytest.mark.parametrize("rule, said", [(dict(factor=1.0), "the factor rule (factor=1.0)"),
                                        (dict(threshold=0.9), "the threshold rule (threshold=0.9)")])
def test_dream_kv_alg_refusal_names_the_rule_in_force(rule, said):
    from mdm_lens.config import MDMConfig
    from mdm_lens.errors import SamplerConfigError

    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_mlp=32, d_vocab=40, n_ctx=32, mask_token_id=39,
                    position_policy="cumsum", padding_mask="pair", logit_shift=True, family="dream")
    model = HookedMDM.from_config(cfg, seed=0)
    with pytest.raises(SamplerConfigError, match=re.escape(f"ranks by {said} whatever alg says; leave alg unset")):
        model.generate(torch.tensor([[5, 6, 7]]), gen_length=8, kv_cache="dual", block_length=4, alg="entropy", **rule)
