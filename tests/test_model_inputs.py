"""Model inputs and loading arguments: padding semantics, typed errors for every wrong argument, EOS/EoT
ids from the checkpoint's own files, corrupt files, name typos, and property-based checks of forward /
run_with_cache arguments (valid ones never raise, invalid ones raise the typed error)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdm_lens import (ArgumentError, ArgumentTypeError, CheckpointError, CheckpointNotFoundError, ConfigError,
                      HookedMDM, HookNameError, InputError, MDMConfig, UnknownModelError)
from mdm_lens.errors import InputTypeError
from tiny_checkpoints import hf_reference, write_dream, write_hf, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream, "llama": write_hf, "qwen2": write_hf}


def tiny(**kw):
    base = dict(d_model=16, n_layers=1, n_heads=2, d_mlp=24, d_vocab=30, mask_token_id=29, pad_token_id=0,
                bos_token_id=1)
    base.update(kw)
    return HookedMDM.from_config(MDMConfig(**base), seed=0, init_std=0.3)


# --- padding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llada", "dream", "llama", "qwen2"])
def test_right_padded_rows_equal_each_row_alone(tmp_path, family):
    """Key padding with absolute positions (LLaDA, ARMs) and Dream's pair mask + cumulative positions: a
    right-padded row gives, at every real position, exactly the logits of that row run alone."""
    model = HookedMDM.from_pretrained(str(WRITERS[family](hf_reference(family), tmp_path / family)))
    lengths = [9, 5, 2]
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 90, (n,), generator=g) for n in lengths]
    tokens = torch.full((3, 9), 1)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        batch = model(tokens, attention_mask=mask, return_type="aligned")
        for i, r in enumerate(rows):
            alone = model(r[None], return_type="aligned")[0]
            assert (batch[i, : len(r)] - alone).abs().max().item() <= 1e-5, (family, i)
        tokens[1, 5:] = 7  # whatever sits in the pads never reaches a real position
        again = model(tokens, attention_mask=mask, return_type="aligned")
    assert (again[1, :5] - batch[1, :5]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("padding_mask", ["pair", "key"])
def test_pad_query_rows_see_nothing_under_the_pair_mask_only(padding_mask):
    """Dream's pair mask hides pad *queries* too (their rows are all zero); LLaDA's key padding lets them attend."""
    model = tiny(padding_mask=padding_mask)
    tokens = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    _, cache = model.run_with_cache(tokens, attention_mask=am, names_filter="blocks.0.attn.hook_pattern")
    pat = cache["blocks.0.attn.hook_pattern"]                      # [batch, head, query, key]
    assert pat[0, ..., :2].abs().max().item() == 0.0                # pad keys are hidden either way
    pad_rows = pat[0, :, :2].sum(-1)
    expected = torch.zeros_like(pad_rows) if padding_mask == "pair" else torch.ones_like(pad_rows)
    assert torch.allclose(pad_rows, expected, atol=1e-6)
    assert torch.allclose(pat[:, :, 2:].sum(-1), torch.ones(2, 2, 3), atol=1e-6)


def test_leading_pads_without_a_mask_warn_and_with_a_mask_do_not():
    model = tiny()
    tokens = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]])
    with pytest.warns(UserWarning, match="start with the pad id 0 but no attention_mask"):
        model(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(tokens, attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        model(torch.tensor([[4, 0, 5]]))  # a pad id inside a row is just a token


def test_all_zero_attention_mask_row_is_an_error():
    model = tiny()
    with pytest.raises(InputError, match=r"row\(s\) \[1\] are all zero"):
        model(torch.tensor([[4, 5], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize("mask, match", [
    (torch.tensor([[1, 2, 1]]), "other than 0 and 1"),
    ([[1, 1, 1]], "expected a tensor"),
    (torch.tensor([[1, 1]]), "attention_mask shape"),
    (torch.ones(1, 3, dtype=torch.complex64), "dtype"),
])
def test_bad_attention_masks(mask, match):
    with pytest.raises(InputError, match=match):
        tiny()(torch.tensor([[4, 5, 6]]), attention_mask=mask)


def test_attn_mask_and_position_ids_are_checked():
    model = tiny()
    tokens = torch.tensor([[4, 5, 6]])
    with pytest.raises(InputTypeError, match="bool tensor"):
        model(tokens, attn_mask=torch.ones(3, 3))
    with pytest.raises(InputError, match="hides every key from query position 1"):
        model(tokens, attn_mask=torch.tensor([[True, False, False], [False, False, False], [True, True, True]]))
    with pytest.raises(InputError, match="position_ids shape"):
        model(tokens, position_ids=torch.arange(4))
    with pytest.raises(InputError, match=">= 0"):
        model(tokens, position_ids=torch.tensor([-1, 0, 1]))
    with pytest.raises(InputTypeError, match="integer positions"):
        model(tokens, position_ids=torch.tensor([0.0, 1.0, 2.0]))
    torch.testing.assert_close(model(tokens, position_ids=torch.arange(3)), model(tokens))


# --- typed errors for wrong arguments ----------------------------------------------------------------
@pytest.mark.parametrize("tokens, error, match", [
    (torch.zeros(1, 0, dtype=torch.long), InputError, "empty"),
    (torch.zeros(0, 4, dtype=torch.long), InputError, "empty"),
    ([], InputError, "empty"),
    (torch.tensor([[1.0, 2.0]]), InputTypeError, "integer token ids"),
    (torch.tensor([[True, False]]), InputTypeError, "integer token ids"),
    (torch.zeros(1, 2, 2, dtype=torch.long), InputError, r"\[batch, pos\]"),
    (torch.tensor(3), InputError, r"\[batch, pos\]"),
    ("hello", InputTypeError, "to_tokens"),
    (["a", "b"], InputTypeError, "to_tokens"),
    ({"ids": 1}, InputTypeError, "expected an integer tensor"),
    (torch.tensor([[1, 30]]), InputError, r"\[0, 30\)"),
    (torch.tensor([[-1, 3]]), InputError, r"\[0, 30\)"),
])
def test_bad_tokens(tokens, error, match):
    with pytest.raises(error, match=match) as info:
        tiny()(tokens)
    assert info.value.argument == "tokens"


def test_return_type_and_hook_arguments():
    model = tiny()
    tokens = torch.tensor([[4, 5]])
    with pytest.raises(InputError, match="return_type"):
        model(tokens, return_type="raw")
    with pytest.raises(ArgumentTypeError, match="one pair, not a list of pairs"):
        model.run_with_hooks(tokens, fwd_hooks=("blocks.0.hook_resid_pre", lambda x, hook: x))
    with pytest.raises(ArgumentTypeError, match=r"fwd_hooks\[0\]"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre",)])
    with pytest.raises(ArgumentTypeError, match="names_filter"):
        model.run_with_cache(tokens, names_filter=3)
    with pytest.raises(ArgumentTypeError, match="remove_batch_dim"):
        model.run_with_cache(tokens, remove_batch_dim="yes")
    with pytest.raises(InputError, match="batch of one"):
        model.run_with_cache(torch.tensor([[4, 5], [5, 6]]), remove_batch_dim=True)
    _, cache = model.run_with_cache(tokens, names_filter=("blocks.0.hook_resid_pre",))  # a tuple works too
    assert list(cache.keys()) == ["blocks.0.hook_resid_pre"]
    assert all(not hp.has_hooks() for hp in model.hook_points())


def test_hook_result_needs_set_use_attn_result():
    model = tiny()
    tokens = torch.tensor([[4, 5, 6]])
    with pytest.raises(HookNameError, match=r"set_use_attn_result\(True\)"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_result", lambda x, hook: x)])
    with pytest.raises(HookNameError, match=r"set_use_attn_result\(True\)"):
        model.run_with_cache(tokens, names_filter=["blocks.0.attn.hook_result"])
    with pytest.raises(HookNameError, match=r"set_use_attn_result\(True\)"):
        model.add_hook("blocks.0.attn.hook_result", lambda x, hook: x)
    _, cache = model.run_with_cache(tokens)  # caching everything simply leaves it out, as TL
    assert "blocks.0.attn.hook_result" not in cache and all(not hp.has_hooks() for hp in model.hook_points())
    with pytest.raises(ArgumentTypeError, match="use_attn_result"):
        model.set_use_attn_result("yes")
    model.set_use_attn_result(True)
    seen = []
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_result", lambda x, hook: seen.append(x.shape))])
    assert seen == [(1, 3, 2, 16)]


# --- text helpers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_to_string_of_a_0d_tensor_is_one_token_as_in_tl(zoo):
    assert zoo.to_string(torch.tensor(5)) == zoo.to_string(torch.tensor([5])) == zoo.to_string([5])
    assert zoo.to_string(5) == zoo.to_string([5])
    assert zoo.to_string(torch.tensor([[5, 6], [7, 8]])) == [zoo.to_string([5, 6]), zoo.to_string([7, 8])]
    with pytest.raises(InputError, match="to_string takes"):
        zoo.to_string(torch.zeros(1, 1, 1, dtype=torch.long))
    with pytest.raises(InputTypeError, match="integer token ids"):
        zoo.to_string(torch.tensor([1.5]))
    assert zoo.to_str_tokens(torch.tensor(5)) == zoo.to_str_tokens([5])


def test_to_tokens_arguments(zoo):
    with pytest.raises(InputError, match="tokenizes to no tokens"):
        zoo.to_tokens("")
    with pytest.raises(InputTypeError, match="non-empty list of str"):
        zoo.to_tokens([])
    with pytest.raises(InputError, match="padding_side"):
        zoo.to_tokens(["a b", "a"], padding_side="middle")
    with pytest.raises(ArgumentTypeError, match="prepend_bos"):
        zoo.to_tokens("a", prepend_bos="no")


# --- from_pretrained arguments, names and files ------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype="fp17"), ArgumentError, "dtype='fp17'.*'float32'"),
    (dict(dtype=32), ArgumentTypeError, "torch.dtype"),
    (dict(dtype=torch.int64), ArgumentError, "floating dtype"),
    (dict(device=0.5), ArgumentTypeError, "device"),
    (dict(device="gpu7"), ArgumentError, "device='gpu7'"),
    (dict(allow_download="yes"), ArgumentTypeError, "allow_download"),
    (dict(load_tokenizer=1), ArgumentTypeError, "load_tokenizer"),
])
def test_from_pretrained_argument_types(kwargs, error, match):
    with pytest.raises(error, match=match):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", **kwargs)


def test_from_pretrained_dtype_names():
    assert HookedMDM.from_pretrained("mdm-lens/tiny-mdm", dtype="bf16").W_E.dtype == torch.bfloat16
    assert HookedMDM.from_pretrained("mdm-lens/tiny-mdm", dtype="torch.float64").W_E.dtype == torch.float64
    with pytest.raises(ArgumentTypeError, match="name_or_path"):
        HookedMDM.from_pretrained(3)
    with pytest.raises(ArgumentError, match="name_or_path=''"):
        HookedMDM.from_pretrained("")


@pytest.mark.parametrize("name", ["mdm-lens/tiny-mdn", "mdm-lens/tiny_mdm", "tiny-mdm", "mdm-lens/Tiny-MDM2"])
def test_zoo_typos_suggest_the_shipped_name(name):
    with pytest.raises(UnknownModelError, match="Did you mean mdm-lens/tiny-mdm"):
        HookedMDM.from_pretrained(name)


def test_hub_typo_not_in_cache_suggests_the_known_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointNotFoundError, match="Did you mean GSAI-ML/LLaDA-8B-Instruct"):
        HookedMDM.from_pretrained("GSAI-ML/LLaDA-8B-Instrcut")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(tmp_path, damage):
    folder = write_llada(hf_reference("llada"), tmp_path / "llada")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00\xff" * 999, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        HookedMDM.from_pretrained(str(folder))


def test_corrupt_shard_names_that_shard(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "llada", sharded=True)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        HookedMDM.from_pretrained(str(folder))


def test_nan_weights_are_a_checkpoint_error(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_llada(hf_reference("llada"), tmp_path / "llada")
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.transformer.blocks.1.v_proj.weight"][3, 4] = float("nan")
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.v_proj\.weight.*NaN"):
        HookedMDM.from_pretrained(str(folder))


# --- EOS / end-of-turn ids from the checkpoint itself --------------------------------------------------
def _tokenizer_files(folder, eos_name="<|endoftext|>", eot=(("<|eot_id|>", 90),), eos_id=91):
    decoder = {str(eos_id): {"content": eos_name, "special": True}}
    decoder.update({str(i): {"content": n, "special": True} for n, i in eot})
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_name,
                                                              "added_tokens_decoder": decoder}))


def test_eos_and_eot_from_a_local_folders_tokenizer_files(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "llada", drop_keys=("eos_token_id",))
    _tokenizer_files(folder)
    cfg = HookedMDM.from_pretrained(str(folder)).cfg
    assert cfg.eos_token_id == 91 and cfg.extra["eot_token_id"] == 90
    assert "tokenizer" in cfg.extra["special_token_sources"]["eos_token_id"]
    # config.json wins over the tokenizer, then generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [88, 89]}))
    cfg = HookedMDM.from_pretrained(str(folder)).cfg
    assert cfg.eos_token_id == 88 and cfg.extra["eos_token_ids"] == [88, 89]
    assert cfg.extra["special_token_sources"]["eos_token_id"] == "generation_config.json"
    json_cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**json_cfg, "eos_token_id": 87}))
    assert HookedMDM.from_pretrained(str(folder)).cfg.eos_token_id == 87


def test_dream_end_of_turn_is_im_end_from_tokenizer_json(tmp_path):
    folder = write_dream(hf_reference("dream"), tmp_path / "dream")
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 2, "<|im_end|>": 93, "<|endoftext|>": 92}, unk_token="a"))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    cfg = HookedMDM.from_pretrained(str(folder)).cfg
    assert cfg.eos_token_id == 92 and cfg.extra["eot_token_id"] == 93


def test_unknown_ids_stay_none_and_reference_constants_never_exceed_the_vocab(tmp_path):
    folder = write_dream(hf_reference("dream"), tmp_path / "dream")
    cfg = HookedMDM.from_pretrained(str(folder)).cfg
    assert cfg.eos_token_id is None and cfg.extra["eot_token_id"] is None
    assert cfg.extra["special_token_sources"] == {"eos_token_id": "unknown", "eot_token_id": "unknown"}
    # LLaDA's generate.py constants (126081 / 126348) are not ids of a 97-token vocabulary
    folder = write_llada(hf_reference("llada"), tmp_path / "llada", drop_keys=("eos_token_id",))
    cfg = HookedMDM.from_pretrained(str(folder)).cfg
    assert cfg.eos_token_id is None and cfg.extra["eot_token_id"] is None


def test_a_malformed_tokenizer_json_is_a_checkpoint_error(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "llada")
    (folder / "tokenizer.json").write_text('{"added_tokens": [{"id": 3}]}')
    with pytest.raises(CheckpointError, match="tokenizer.json could not be read"):
        HookedMDM.from_pretrained(str(folder))
    assert HookedMDM.from_pretrained(str(folder), load_tokenizer=False).tokenizer is None


def test_an_out_of_vocab_id_in_the_files_is_a_config_error(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "llada", config_overrides={"eos_token_id": 500})
    with pytest.raises(ConfigError, match="eos_token_id=500 from config.json"):
        HookedMDM.from_pretrained(str(folder))


def test_zoo_and_native_round_trip_keep_their_ids(tmp_path):
    from mdm_lens.loading import save_pretrained

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    assert model.cfg.eos_token_id == 2 and model.cfg.extra["eot_token_id"] is None
    model.cfg.extra["eot_token_id"] = 4
    again = HookedMDM.from_pretrained(str(save_pretrained(model, tmp_path / "native")))
    assert again.cfg.eos_token_id == 2 and again.cfg.extra["eot_token_id"] == 4


# --- property-based: valid forward / run_with_cache arguments never raise, invalid ones raise typed -----
PROP = tiny()
V, MASK, PAD = 30, 29, 0


@st.composite
def valid_call(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    tokens = torch.tensor(draw(st.lists(st.lists(st.integers(0, V - 1), min_size=t, max_size=t), min_size=b,
                                        max_size=b)))
    kwargs = {"return_type": draw(st.sampled_from(["logits", "aligned", "raw_and_aligned", None]))}
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
        left = draw(st.booleans())
        mask = torch.zeros(b, t, dtype=torch.long)
        for i, n in enumerate(lengths):  # n real tokens, padded on the left or on the right
            (mask[i, t - n:] if left else mask[i, :n]).fill_(1)
        tokens = tokens.masked_fill(mask == 0, PAD)
        kwargs["attention_mask"] = mask.bool() if draw(st.booleans()) else mask
    if draw(st.booleans()):
        kwargs["position_ids"] = torch.tensor(draw(st.lists(st.integers(0, 50), min_size=t, max_size=t)))
    return tokens, kwargs


BAD = {
    "float tokens": lambda t: (t.float(), {}),
    "id too large": lambda t: (t.masked_fill(torch.zeros_like(t, dtype=torch.bool).index_fill(1, torch.tensor([0]),
                                                                                             True), V), {}),
    "negative id": lambda t: (t - V, {}),
    "3-d tokens": lambda t: (t[None], {}),
    "empty": lambda t: (t[:, :0], {}),
    "mask value 2": lambda t: (t, {"attention_mask": torch.full_like(t, 2)}),
    "mask all zero": lambda t: (t, {"attention_mask": torch.zeros_like(t)}),
    "mask shape": lambda t: (t, {"attention_mask": torch.ones(t.shape[0], t.shape[1] + 1, dtype=torch.long)}),
    "mask a list": lambda t: (t, {"attention_mask": t.tolist()}),
    "pads are the mask id": lambda t: (t.index_fill(1, torch.tensor([0]), MASK),
                                       {"attention_mask": torch.ones_like(t).index_fill(1, torch.tensor([0]), 0)}),
    "return_type": lambda t: (t, {"return_type": "probs"}),
    "attn_mask int": lambda t: (t, {"attn_mask": torch.ones(t.shape[1], t.shape[1], dtype=torch.long)}),
    "position_ids negative": lambda t: (t, {"position_ids": torch.full((t.shape[1],), -1)}),
    "position_ids float": lambda t: (t, {"position_ids": torch.zeros(t.shape[1])}),
    "text": lambda t: ("some text", {}),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_call())
def test_valid_forward_arguments_never_raise(call):
    tokens, kwargs = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # leading pads without a mask only warn
        out = PROP(tokens, **kwargs)
        _, cache = PROP.run_with_cache(tokens, names_filter="blocks.0.attn.hook_pattern", **kwargs)
    if kwargs["return_type"] is not None:
        logits = out[0] if kwargs["return_type"] == "raw_and_aligned" else out
        assert logits.shape == (*tokens.shape, V) and torch.isfinite(logits).all()
    assert torch.isfinite(cache["blocks.0.attn.hook_pattern"]).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_call(), st.sampled_from(sorted(BAD)))
def test_invalid_forward_arguments_raise_the_typed_error(call, kind):
    tokens, _ = call
    bad_tokens, kwargs = BAD[kind](tokens)
    for run in (PROP, lambda *a, **k: PROP.run_with_cache(*a, **k), lambda *a, **k: PROP.run_with_hooks(*a, **k)):
        with pytest.raises(ArgumentError) as info:
            run(bad_tokens, **kwargs)
        assert info.value.argument is not None and str(info.value)
    assert all(not hp.has_hooks() for hp in PROP.hook_points())
