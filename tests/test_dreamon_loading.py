"""DreamOn checkpoints in the hub layout (a `DreamModel` config.json, safetensors weights, tokenizer files naming
`<|expand|>`): the loader reads the expand token and the tokenizer's EOS (DreamOn's delete token) so that
`sampler="dreamon"` runs without cfg.extra edits, token-exact against the reference transcription."""

from __future__ import annotations

import json

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError, SamplerConfigError
from tests.dreamon_reference import reference_expand_generate
from tests.tiny_checkpoints import hf_reference, write_dream

MASK, EXPAND, ENDOFTEXT, CONFIG_EOS = 95, 96, 3, 4  # config.json's eos differs from the tokenizer's on purpose
PREFIX = torch.tensor([[10, 11, 12, 13]])
SUFFIX = [20, 21]


def _tokenizer_json(folder):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    special = {ENDOFTEXT: "<|endoftext|>", MASK: "<|mask|>", EXPAND: "<|expand|>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(n, special=True) for n in special.values()])
    tok.save(str(folder / "tokenizer.json"))


def dreamon_checkpoint(folder, layout="tokenizer.json", expand=EXPAND):
    """A tiny Dream-layout checkpoint whose tokenizer files name `<|expand|>` the DreamOn way."""
    write_dream(hf_reference("dream", seed=3), folder, config_overrides={"mask_token_id": MASK,
                                                                         "eos_token_id": CONFIG_EOS})
    tok_cfg = {"eos_token": "<|endoftext|>", "mask_token": "<|mask|>"}
    if layout == "tokenizer.json":
        _tokenizer_json(folder)
    else:  # tokenizer_config.json's added_tokens_decoder only (a slow-tokenizer folder)
        tok_cfg["added_tokens_decoder"] = {str(ENDOFTEXT): {"content": "<|endoftext|>", "special": True},
                                           str(MASK): {"content": "<|mask|>", "special": True},
                                           str(expand): {"content": "<|expand|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return folder


@pytest.mark.parametrize("layout", ["tokenizer.json", "tokenizer_config.json"])
def test_expand_and_delete_tokens_are_read_from_the_tokenizer_files(tmp_path, layout):
    folder = dreamon_checkpoint(tmp_path / "DreamOn-tiny", layout)
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert (model.cfg.extra["expand_token_id"], model.cfg.extra["delete_token_id"]) == (EXPAND, ENDOFTEXT)
    assert model.cfg.eos_token_id == CONFIG_EOS  # config.json's own EOS is kept for the other samplers
    assert "<|expand|>" in model.cfg.extra["special_token_sources"]["expand_token_id"]
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=16, min_gen_len=2, max_gen_len=6, seed=0)
    assert (out.settings["expand_id"], out.settings["eos_id"]) == (EXPAND, ENDOFTEXT)
    # the canvas closes with the tokenizer's EOS, as the reference's encode(suffix, add_eos=True)
    assert int(out.tokens[0, -1]) == ENDOFTEXT
    inp = torch.cat([PREFIX, torch.full((1, 2), MASK), torch.tensor([SUFFIX + [ENDOFTEXT]])], 1)
    ref, n_gen = reference_expand_generate(model, inp, mask_id=MASK, expand_id=EXPAND, eos_id=ENDOFTEXT, steps=16,
                                           min_gen_len=2, max_gen_len=6, alg="entropy", alg_temp=0.0,
                                           temperature=0.1, top_p=0.9, top_k=None, delete_eos_token=True,
                                           pad_eos_to_right=True, seed=0)
    assert out.answer_length == [n_gen] and torch.equal(out.tokens, ref[:, :inp.shape[1] - 2 + n_gen])


def test_a_plain_dream_checkpoint_gets_no_expand_token(tmp_path):
    folder = tmp_path / "Dream-tiny"
    write_dream(hf_reference("dream", seed=3), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    model = HookedMDM.from_pretrained(str(folder))
    assert "expand_token_id" not in model.cfg.extra and "delete_token_id" not in model.cfg.extra
    with pytest.raises(SamplerConfigError, match="expand token"):
        model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=4)


@pytest.mark.parametrize("expand, match", [(MASK, "same as the mask token"), (500, "outside the vocabulary")])
def test_a_bad_expand_token_is_refused_at_load(tmp_path, expand, match):
    folder = dreamon_checkpoint(tmp_path / "bad", "tokenizer_config.json", expand=expand)
    if expand == MASK:  # the mask entry names <|expand|> instead
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["added_tokens_decoder"].pop(str(MASK))
        cfg["added_tokens_decoder"][str(MASK)] = {"content": "<|expand|>", "special": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
