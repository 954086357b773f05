"""Misuse round three, second half (issue #32): S3-S5, C3-C7, U1, U5-U7.

Each case names the typed error, the argument it must name and, where a call still works, its exact result.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import (ArgumentError, ArgumentTypeError, ConfigError, InputError, InputTypeError,
                             OutOfRangeError)
from mdm_lens.probes import patching as PT
from mdm_lens.probes import run as R

CFG = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49)


@pytest.fixture(scope="module")
def model():
    return HookedMDM.from_config(CFG, seed=3, init_std=0.2, init="realistic")


@pytest.fixture(scope="module")
def cache(model):
    x = torch.tensor([[1, 5, 9, 12, 49, 49, 7, 3]])
    return model.run_with_cache(x)[1]


# ------------------------------------------------------------------ S3 / C6 / C7: ActivationCache helpers

@pytest.mark.parametrize("mode", ["attention", "foo", "ATTN", None])
def test_decompose_resid_refuses_an_unknown_mode(cache, mode):
    with pytest.raises(ArgumentError) as e:
        cache.decompose_resid(layer=-1, mode=mode)
    assert e.value.argument == "mode"


def test_decompose_resid_modes_select_their_components(cache):
    # 2 layers: all = embed + 2 attn + 2 mlp; attn = embed + 2 attn (TL keeps the embedding unless incl_embeds=False)
    _, labels_all = cache.decompose_resid(layer=-1, mode="all", return_labels=True)
    _, labels_attn = cache.decompose_resid(layer=-1, mode="attn", return_labels=True)
    _, labels_mlp = cache.decompose_resid(layer=-1, mode="mlp", incl_embeds=False, return_labels=True)
    assert labels_all == ["embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    assert labels_attn == ["embed", "0_attn_out", "1_attn_out"]
    assert labels_mlp == ["0_mlp_out", "1_mlp_out"]


@pytest.mark.parametrize("pos_slice,error", [(99, OutOfRangeError), (-9, OutOfRangeError), ("a", ArgumentTypeError),
                                             (2.0, ArgumentTypeError), (True, ArgumentTypeError),
                                             ((2, 99), OutOfRangeError), ((6, 2), OutOfRangeError),
                                             ([0, 8], OutOfRangeError), ([[0, 1]], ArgumentTypeError),
                                             ((0, 4, 0), ArgumentError)])
def test_accumulated_resid_checks_pos_slice(cache, pos_slice, error):
    with pytest.raises(error) as e:
        cache.accumulated_resid(pos_slice=pos_slice)
    assert e.value.argument.startswith("pos_slice")


@pytest.mark.parametrize("pos_slice,n", [(7, None), (-8, None), ((2, 5), 3), (slice(0, 8, 2), 4), ([0, 0, 7], 3),
                                         (torch.tensor([1, 2]), 2), ((8,), 8)])
def test_accumulated_resid_valid_pos_slices_select_exactly(cache, pos_slice, n):
    full = cache.accumulated_resid(layer=-1)                  # [layers+1, batch, pos, d_model]
    got = cache.accumulated_resid(layer=-1, pos_slice=pos_slice)
    idx = torch.arange(8)[pos_slice if not isinstance(pos_slice, tuple) else slice(*pos_slice)]
    torch.testing.assert_close(got, full[:, :, idx], rtol=0, atol=0)
    if n is not None:
        assert got.shape[2] == n


@pytest.mark.parametrize("helper", ["accumulated_resid", "decompose_resid", "get_full_resid_decomposition",
                                    "stack_head_results"])
def test_every_residual_helper_checks_flags_slices_and_keywords(cache, helper):
    fn = getattr(cache, helper)
    with pytest.raises(ArgumentTypeError) as e:
        fn(apply_ln=1)
    assert e.value.argument == "apply_ln"
    with pytest.raises(OutOfRangeError) as e:
        fn(pos_slice=8)
    assert e.value.argument == "pos_slice"
    with pytest.raises(ArgumentError) as e:
        fn(pos_slices=1)
    assert e.value.argument == "pos_slices" and "pos_slice=" in str(e.value)


def test_apply_ln_to_stack_and_batch_slice_are_checked(cache):
    stack = cache.accumulated_resid(layer=-1)
    with pytest.raises(OutOfRangeError) as e:
        cache.apply_ln_to_stack(stack, layer=-1, batch_slice=1)
    assert e.value.argument == "batch_slice"
    with pytest.raises(ArgumentTypeError) as e:
        cache.apply_ln_to_stack(stack, layer=-1, recompute_ln="yes")
    assert e.value.argument == "recompute_ln"
    with pytest.raises(OutOfRangeError):
        cache.apply_slice_to_batch_dim(3)


def test_logit_attrs_names_incorrect_tokens_of_another_shape(cache):
    r = cache.accumulated_resid(-1, pos_slice=-1)
    with pytest.raises(ArgumentError) as e:
        cache.logit_attrs(r, tokens=torch.tensor([5]), incorrect_tokens=torch.tensor([1, 2, 3]), pos_slice=-1)
    assert e.value.argument == "incorrect_tokens" and "(3,)" in str(e.value) and "(1,)" in str(e.value)
    with pytest.raises(ArgumentError) as e:
        cache.logit_attrs(r, tokens=5, incorrect_tokens=torch.tensor([1, 2]), pos_slice=-1)
    assert e.value.argument == "incorrect_tokens"
    with pytest.raises(OutOfRangeError) as e:
        cache.logit_attrs(r, tokens=5, pos_slice=99)
    assert e.value.argument == "pos_slice"


def test_logit_attrs_difference_sums_to_the_logit_difference(model, cache):
    # a list of ids works like a tensor; the attributions of the full decomposition sum to the logit difference
    x = torch.tensor([[1, 5, 9, 12, 49, 49, 7, 3]])
    logits = model(x)[0, -1].double()
    stack = cache.decompose_resid(layer=-1, pos_slice=-1)
    attrs = cache.logit_attrs(stack, tokens=[5], incorrect_tokens=[9], pos_slice=-1)
    want = logits[5] - logits[9]
    torch.testing.assert_close(attrs.sum(0).double(), want.reshape(1), rtol=1e-5, atol=1e-5 * float(logits.abs().max()))


# ------------------------------------------------------------------ C5 / U1: tokens_to_residual_directions

def test_tokens_to_residual_directions_ragged_and_empty(model):
    with pytest.raises(InputTypeError) as e:
        model.tokens_to_residual_directions([[1, 2], [3]])
    assert e.value.argument == "tokens"
    for empty in ([], [[]]):
        with pytest.raises(ArgumentError) as e:
            model.tokens_to_residual_directions(empty)
        assert e.value.argument == "tokens" and "empty" in str(e.value)
        assert not isinstance(e.value, ArgumentTypeError)
    got = model.tokens_to_residual_directions([[1, 2], [3, 4]])
    assert got.shape == (2, 2, CFG.d_model)
    torch.testing.assert_close(got[1, 0], model.tokens_to_residual_directions(3), rtol=0, atol=0)


# ------------------------------------------------------------------ C3 / C4: process_weights_, incl_bwd

@pytest.mark.parametrize("key,near", [("fold_layernorm", "fold_ln"), ("center_writing_weights", None),
                                      ("center_unembedding", "center_unembed")])
def test_process_weights_refuses_unknown_keywords(key, near):
    m = HookedMDM.from_config(CFG, seed=3, init_std=0.2, init="realistic")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ArgumentError) as e:
        m.process_weights_(**{key: True})
    assert e.value.argument == key
    assert (f"Did you mean {near}=?" in str(e.value)) == (near is not None)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # refused before touching weights


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_incl_bwd_under_no_grad_is_refused_before_the_forward(model, ctx):
    x = torch.tensor([[1, 5, 9, 12, 49, 49, 7, 3]])
    clean = torch.tensor([[1, 5, 9, 12, 20, 21, 7, 3]])
    calls = []
    model.blocks[0].hook_resid_pre.add_hook(lambda t, hook: calls.append(1))
    try:
        with ctx(), pytest.raises(InputError) as e:
            model.run_with_cache(x, return_type="loss", targets=clean, incl_bwd=True)
    finally:
        model.reset_hooks()
    assert e.value.argument == "incl_bwd" and ctx.__name__ in str(e.value)
    assert calls == []
    _, c = model.run_with_cache(x, return_type="loss", targets=clean, incl_bwd=True)  # with grad: it works
    assert "blocks.0.hook_resid_pre_grad" in c.cache_dict


# ------------------------------------------------------------------ S4 / U7: item spans

@pytest.fixture(scope="module")
def item():
    from mdm_lens.zoo.sampling import make_dataset

    return make_dataset(3, 0, n_distractors=1)[0]


@pytest.mark.parametrize("field,value", [("passage_spans", "one"), ("passage_spans", "far"),
                                         ("question_span", (50, 10)), ("question_span", (-1, 5)),
                                         ("evidence_span", (0, 10 ** 6)), ("marker_spans", "one")])
def test_item_spans_outside_reversed_or_miscounted_are_refused(item, field, value):
    n = len(item.prompt)
    if value == "one":
        value = [getattr(item, field)[0]]
    elif value == "far":
        value = [item.passage_spans[0], (0, 10 ** 6)]
    with pytest.raises(InputError) as e:
        dataclasses.replace(item, **{field: value})
    assert e.value.argument.startswith(field) and item.question in str(e.value)
    assert field in str(e.value) and (str(n) in str(e.value) or "passage" in str(e.value))


def test_flow_for_items_rechecks_spans_assigned_after_construction(item):
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    bad = dataclasses.replace(item)
    bad.passage_spans = [(0, 10 ** 6)]
    with pytest.raises(InputError) as e:
        R.flow_for_items(m, [bad])
    assert e.value.argument == "passage_spans"
    good = R.regions_for_item(item, 0, [(i, i + 1) for i in range(len(item.prompt))])
    named = [r.name for r in good if not r.name.startswith("other")]   # gaps are explicit "other" regions
    assert named == ["bos", "doc1", "doc2", "question_cue", "query", "answer_cue"]


# ------------------------------------------------------------------ S5: inert rule

def test_knockout_refuses_a_rule_with_explicit_targets():
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    p = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with pytest.raises(ArgumentError) as e:
        PT.knockout(m, p, targets=[0], rule="topk", n_random=0, gen_length=2, n_steps=2)
    assert e.value.argument == "rule" and "targets" in str(e.value)
    r = PT.knockout(m, p, targets=[0], n_random=0, gen_length=2, n_steps=2)   # default rule: accepted
    assert r is not None


def test_qk_at_layer_refuses_a_rule_with_a_given_anchor(model):
    x = torch.tensor([[1, 5, 9, 12, 49, 49, 7, 3]])
    for anchor in (0, "zscore", torch.tensor([0])):
        with pytest.raises(ArgumentError) as e:
            R.qk_at_layer(model, x, 0, anchor=anchor, rule="zscore")
        assert e.value.argument == "rule" and "anchor" in str(e.value)
    R.qk_at_layer(model, x, 0, anchor=0)


# ------------------------------------------------------------------ U5 / U6: files

def test_read_items_on_a_directory_says_so(tmp_path):
    from mdm_lens.sweep.items import read_items

    with pytest.raises(InputError) as e:
        read_items(tmp_path)
    assert "is a directory" in str(e.value) and e.value.argument == "data"
    with pytest.raises(InputError) as e:
        read_items(tmp_path / "nope.jsonl")
    assert "no such file" in str(e.value)


@pytest.mark.parametrize("key", ["d_model", "n_layers"])
def test_native_config_missing_a_required_key_names_it(tmp_path, key):
    m = HookedMDM.from_config(CFG, seed=3, init_std=0.2, init="realistic")
    from mdm_lens.loading import save_pretrained

    folder = save_pretrained(m, tmp_path / "native")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        HookedMDM.from_pretrained(str(folder))
    assert f"lacks the required key {key}" in str(e.value) and "wrong type" not in str(e.value)
