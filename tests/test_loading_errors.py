"""Name resolution (local folder, HF cache, offline), registry facts, and typed, actionable errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mdm_lens import (CheckpointError, CheckpointNotFoundError, ConfigError, HookedMDM, InputError, MDMConfig,
                      UnknownModelError)
from mdm_lens.loading import resolve, save_pretrained
from mdm_lens.loading.registry import KNOWN_MODELS
from tiny_checkpoints import hf_reference, write_dream, write_llada


@pytest.fixture
def llada_dir(tmp_path):
    return write_llada(hf_reference("llada"), tmp_path / "llada")


def test_registry_knows_the_real_checkpoints():
    for name in ["GSAI-ML/LLaDA-8B-Base", "GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-1.5",
                 "Dream-org/Dream-v0-Base-7B", "Dream-org/Dream-v0-Instruct-7B", "meta-llama/Meta-Llama-3-8B",
                 "meta-llama/Meta-Llama-3-8B-Instruct", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"]:
        assert name in KNOWN_MODELS
    assert KNOWN_MODELS["GSAI-ML/LLaDA-8B-Instruct"].mask_token_id == 126336
    assert KNOWN_MODELS["Dream-org/Dream-v0-Instruct-7B"].mask_token_id == 151666
    assert KNOWN_MODELS["GSAI-ML/LLaDA-8B-Instruct"].special["<|eot_id|>"] == 126348


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownModelError, match="LLaDA-8B-Instruct"):
        HookedMDM.from_pretrained("llada-8b")


def test_missing_hub_model_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointNotFoundError, match="hf download GSAI-ML/LLaDA-8B-Instruct"):
        HookedMDM.from_pretrained("GSAI-ML/LLaDA-8B-Instruct")


def test_hub_id_resolves_through_the_hf_cache(tmp_path, monkeypatch, llada_dir):
    """A checkpoint laid out as huggingface_hub caches it is found offline, by its hub id."""
    hub = tmp_path / "hub"
    repo = hub / "models--GSAI-ML--LLaDA-8B-Instruct"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(llada_dir, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, known = resolve("GSAI-ML/LLaDA-8B-Instruct")
    assert folder == snap and known is not None
    model = HookedMDM.from_pretrained("GSAI-ML/LLaDA-8B-Instruct")
    # config.json is the checkpoint's own truth (this tiny vocab has no id 126336); the registry adds
    # the facts config.json lacks, such as the special-token table
    assert model.cfg.mask_token_id == 95 and model.cfg.extra["special_tokens"]["<|mdm_mask|>"] == 126336


def test_missing_local_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no folder"):
        HookedMDM.from_pretrained(str(tmp_path / "nothing_here"))


def test_folder_without_weights(tmp_path, llada_dir):
    (llada_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no weights"):
        HookedMDM.from_pretrained(str(llada_dir))


def test_missing_and_extra_tensors_are_named(llada_dir):
    path = llada_dir / "model.safetensors"
    sd = load_file(str(path))
    sd.pop("model.transformer.blocks.1.up_proj.weight")
    sd["model.transformer.blocks.1.surprise.weight"] = torch.zeros(2)
    save_file(sd, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.up_proj.*blocks\.1\.surprise|missing.*unexpected"):
        HookedMDM.from_pretrained(str(llada_dir))


def test_shape_mismatch_names_the_tensor(llada_dir):
    cfg = json.loads((llada_dir / "config.json").read_text())
    cfg["mlp_hidden_size"] = 80
    (llada_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.transformer\.blocks\.0\.ff_proj\.weight has shape \(96, 64\), expected \(80, 64\)"):
        HookedMDM.from_pretrained(str(llada_dir))


def test_unsupported_variants_are_config_errors(tmp_path):
    folder = write_dream(hf_reference("dream"), tmp_path / "dream")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="yarn"):
        HookedMDM.from_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="not a supported family"):
        HookedMDM.from_pretrained(str(folder))


def test_remote_code_is_never_executed(llada_dir):
    (llada_dir / "modeling_llada.py").write_text("raise SystemExit('remote code ran')\n")
    HookedMDM.from_pretrained(str(llada_dir))  # auto_map is in config.json; it must be ignored


def test_native_round_trip(tmp_path):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=40, mask_token_id=39,
                    tie_word_embeddings=True, family="mdm_lens", extra={"gen_length": 4})
    model = HookedMDM.from_config(cfg, seed=3)
    folder = save_pretrained(model, tmp_path / "native")
    again = HookedMDM.from_pretrained(str(folder))
    assert again.unembed.weight is again.embed.W_E and again.cfg.extra["gen_length"] == 4
    tokens = torch.randint(0, 39, (2, 6))
    torch.testing.assert_close(again(tokens), model(tokens))


def test_input_errors():
    cfg = MDMConfig(d_model=32, n_layers=1, n_heads=4, d_mlp=48, d_vocab=40, mask_token_id=39)
    model = HookedMDM.from_config(cfg)
    with pytest.raises(InputError, match="mask token id 39"):
        model(torch.tensor([[39, 39, 5, 6]]), attention_mask=torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(InputError, match=r"\[0, 40\)"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(InputError, match="attention_mask shape"):
        model(torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1]]))
    with pytest.raises(InputError, match="to_tokens"):
        model("hello")
    with pytest.raises(InputError, match="no tokenizer"):
        model.to_tokens("hello")
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        MDMConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=3, d_mlp=8, d_vocab=10)


def _edit(folder, **values):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("bad_id", [97, 1000, -1])
def test_a_bad_mask_token_id_is_reported_at_load_naming_the_key(tmp_path, family, bad_id):
    writer = write_llada if family == "llada" else write_dream
    folder = writer(hf_reference(family), tmp_path / family)  # vocab_size 97: ids 0..96
    _edit(folder, mask_token_id=bad_id)
    match = r"mask_token_id=-1 is invalid" if bad_id < 0 else rf"mask_token_id={bad_id} is .*\[0, (d_vocab=)?97\)"
    with pytest.raises(ConfigError, match=match) as info:
        HookedMDM.from_pretrained(str(folder))
    assert "config.json" in str(info.value)


def test_every_eos_id_of_a_list_must_be_in_the_vocabulary(tmp_path):
    folder = write_dream(hf_reference("dream"), tmp_path / "dream")
    _edit(folder, eos_token_id=[1, 500])
    with pytest.raises(ConfigError, match=r"eos_token_id=\[1, 500\] from config.json .* is outside the vocabulary \[0, 97\)"):
        HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_absent_mask_id_never_takes_a_reference_constant_outside_the_vocabulary(tmp_path, family):
    writer = write_llada if family == "llada" else write_dream
    folder = writer(hf_reference(family), tmp_path / family, drop_keys=("mask_token_id",))
    # 126336 (LLaDA) / 151666 (Dream) do not fit a 97-token vocabulary: no mask id rather than a wrong one
    assert HookedMDM.from_pretrained(str(folder)).cfg.mask_token_id is None


@pytest.mark.parametrize("family,key,value,expected", [
    ("llada", "d_model", None, "an int > 0"), ("llada", "n_heads", "4", "an int > 0"),
    ("llada", "n_layers", 0, "an int > 0"), ("llada", "vocab_size", -5, "an int > 0"),
    ("llada", "max_sequence_length", 256.0, "an int > 0"), ("llada", "rms_norm_eps", None, "a finite number >= 0"),
    ("llada", "rope_theta", None, "a finite number > 0"), ("llada", "weight_tying", "yes", "true or false"),
    ("llada", "n_kv_heads", 0, "an int > 0 or null"), ("llada", "pad_token_id", 1.5, "an int >= 0 or null"),
    ("dream", "hidden_size", None, "an int > 0"), ("dream", "num_attention_heads", True, "an int > 0"),
    ("dream", "intermediate_size", -96, "an int > 0"), ("dream", "vocab_size", None, "an int > 0"),
    ("dream", "rms_norm_eps", -1e-6, "a finite number >= 0"), ("dream", "num_key_value_heads", "2", "an int > 0 or null"),
    ("dream", "eos_token_id", [1, "x"], "an int >= 0 or a list of them or null"), ("dream", "tie_word_embeddings", None, "true or false"),
])
def test_every_config_value_is_type_and_range_checked(tmp_path, family, key, value, expected):
    writer = write_llada if family == "llada" else write_dream
    folder = writer(hf_reference(family), tmp_path / family)
    _edit(folder, **{key: value})
    with pytest.raises(ConfigError, match=rf"config.json: {key}=.* is invalid: expected {expected}"):
        HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("field,value", [("d_model", 0), ("n_layers", None), ("d_vocab", 4.0), ("n_ctx", -1),
                                         ("n_kv_heads", 0), ("rope_theta", 0.0), ("rope_theta", float("nan")),
                                         ("norm_eps", None), ("mask_token_id", 10), ("pad_token_id", -1),
                                         ("qkv_bias", 1)])
def test_mdm_config_checks_every_number(field, value):
    base = dict(d_model=8, n_layers=1, n_heads=2, d_mlp=8, d_vocab=10)
    with pytest.raises(ConfigError, match=rf"{field}=.* is invalid"):
        MDMConfig(**{**base, field: value})
