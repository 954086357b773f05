"""RND1 and CoDA load from their hub layouts without remote code, exactly (fp32) against plain-torch
transcriptions of the pinned references (rnd1_coda_reference.py), with every config key the loaders read set away
from its default in the tiny checkpoints."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from family_checkpoints import MASK_ID, VOCAB
from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError
from mdm_lens.loading.rnd1 import FORCED, ReferenceConfigWarning, forced_disagreements
from mdm_lens.model import shift_logits
from rnd1_coda_checkpoints import write_coda, write_rnd1
from rnd1_coda_reference import coda_forward, rnd1_forward

TOL = 1e-4


def _tokens(seed: int = 3, batch: int = 2, n: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 4, (batch, n), generator=g)
    tokens[:, 6:9] = MASK_ID
    return tokens


def _load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceConfigWarning)
        return HookedMDM.from_pretrained(folder)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_rnd1_matches_the_reference_forward(tmp_path, norm_topk_prob):
    folder, config, sd = write_rnd1(tmp_path / "rnd1", norm_topk_prob=norm_topk_prob)
    model = _load(folder)
    assert model.cfg.family == "rnd1" and model.cfg.logit_shift and model.cfg.attention == "bidirectional"
    assert (model.cfg.d_head, model.cfg.n_kv_heads, model.cfg.norm_eps, model.cfg.rope_theta) == (24, 2, 1e-5, 5e5)
    assert model.cfg.extra["moe"]["top_k"] == 3 and model.cfg.extra["moe"]["renorm"] is norm_topk_prob
    assert all(block.is_moe for block in model.blocks)
    tokens = _tokens()
    with torch.no_grad():
        expected = rnd1_forward(sd, config, tokens)
        raw, aligned = model(tokens), model(tokens, return_type="aligned")
    scale = expected.abs().max()
    assert (raw - expected).abs().max() <= TOL * scale
    assert torch.equal(aligned, shift_logits(raw))  # position i is read from hidden state i-1
    flipped = rnd1_forward(sd, {**config, "norm_topk_prob": not norm_topk_prob}, tokens)
    assert (flipped - expected).abs().max() > 1e-3 * scale  # the planted config key is visible in the output


def test_rnd1_routing_weights_stay_fp32_in_bf16(tmp_path):
    """The reference multiplies each expert's bf16 output by the fp32 weight, then rounds: the library matches it
    closer than the Qwen3-MoE order (weights rounded to bf16 first) does."""
    folder, config, sd = write_rnd1(tmp_path / "rnd1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceConfigWarning)
        model = HookedMDM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.blocks[0].mlp.fp32_weights
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sd16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    from rnd1_coda_reference import rnd1_moe

    with torch.no_grad():
        expected = rnd1_moe(x, sd16, "model.layers.0.", config)
        ours = model.blocks[0].mlp(x)
        model.blocks[0].mlp.fp32_weights = False
        rounded_first = model.blocks[0].mlp(x)
    assert torch.equal(ours, expected) or (ours - expected).abs().max() < (rounded_first - expected).abs().max()


def test_rnd1_warns_where_the_reference_forces_its_30b_values(tmp_path):
    folder, config, _ = write_rnd1(tmp_path / "rnd1")
    with pytest.warns(ReferenceConfigWarning, match="hidden_size=64 \\(reference: 2048\\)") as record:
        HookedMDM.from_pretrained(folder)
    message = str(record[0].message)
    for key in ("num_experts=8", "head_dim=24", "num_hidden_layers=2", "rope_theta=500000.0", "vocab_size=101"):
        assert key in message
    assert "norm_topk_prob" not in message  # equal to the forced value: no warning for it
    assert set(forced_disagreements(config)) == {k for k in FORCED if k in config and config[k] != FORCED[k]
                                                 and not (k == "rope_theta" and config[k] == 1e6)}


def test_rnd1_silent_when_config_json_agrees_with_the_forced_values(tmp_path):
    """A config.json that states the forced values (as the hub file does) raises no warning."""
    agreeing = {k: v for k, v in FORCED.items() if k not in ("eos_token_id", "pad_token_id", "vocab_size")}
    assert forced_disagreements({**agreeing, "rope_theta": 1000000}) == {}


def test_rnd1_absent_keys_take_the_forced_values(tmp_path):
    folder, _, _ = write_rnd1(tmp_path / "rnd1", drop=("norm_topk_prob", "rms_norm_eps"))
    cfg = _load(folder).cfg
    assert cfg.extra["moe"]["renorm"] is True and cfg.norm_eps == 1e-6


def test_rnd1_mask_id_from_config_and_constants(tmp_path):
    folder, _, _ = write_rnd1(tmp_path / "rnd1")
    cfg = _load(folder).cfg
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (MASK_ID, 98, 99)
    folder, _, _ = write_rnd1(tmp_path / "nomask", drop=("mask_token_id",))
    assert _load(folder).cfg.mask_token_id == MASK_ID  # the tokenizer's <|mask|> (151669 is outside this vocab)


@pytest.mark.parametrize("key,value", [("rope_scaling", {"rope_type": "yarn", "factor": 2.0}),
                                       ("attention_bias", True), ("num_experts_per_tok", 9)])
def test_rnd1_refuses_what_the_reference_cannot_run(tmp_path, key, value):
    folder, _, _ = write_rnd1(tmp_path / "rnd1", **{key: value})
    with pytest.raises(ConfigError, match=key.split("_")[0]):
        _load(folder)


def test_rnd1_value_checks_name_the_key(tmp_path):
    folder, _, _ = write_rnd1(tmp_path / "rnd1")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_experts": "8"}))
    with pytest.raises(ConfigError, match="num_experts='8'"):
        _load(folder)


def test_coda_matches_the_reference_forward(tmp_path):
    folder, config, sd = write_coda(tmp_path / "coda")
    model = HookedMDM.from_pretrained(folder)
    assert model.cfg.family == "coda" and model.cfg.logit_shift and not model.cfg.tie_word_embeddings
    assert model.cfg.qkv_bias and model.cfg.extra["o_bias"] and model.cfg.rope_theta == 2e5
    assert (model.cfg.mask_token_id, model.cfg.bos_token_id, model.cfg.eos_token_id, model.cfg.pad_token_id) == \
        (MASK_ID, 97, 98, 99)
    tokens = _tokens()
    with torch.no_grad():
        expected = coda_forward(sd, config, tokens)
        raw = model(tokens)
    assert (raw - expected).abs().max() <= TOL * expected.abs().max()
    assert model.unembed.weight.data_ptr() != model.embed.W_E.data_ptr()  # lm_head.weight, never the embedding


def test_coda_without_biases_and_default_keys(tmp_path):
    folder, config, sd = write_coda(tmp_path / "coda", attention_bias=False, rms_norm_eps=1e-6)
    model = HookedMDM.from_pretrained(folder)
    assert not model.cfg.qkv_bias and not model.cfg.extra["o_bias"]
    tokens = _tokens(seed=5, batch=1)
    with torch.no_grad():
        assert (model(tokens) - coda_forward(sd, config, tokens)).abs().max() <= TOL * 10


@pytest.mark.parametrize("overrides,match", [({"head_dim": 32}, "hidden_size"),
                                             ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
                                             ({"hidden_act": "gelu"}, "hidden_act")])
def test_coda_refuses_what_the_reference_cannot_run(tmp_path, overrides, match):
    folder, _, _ = write_coda(tmp_path / "coda", **overrides)
    with pytest.raises(ConfigError, match=match):
        HookedMDM.from_pretrained(folder)


def test_coda_absent_keys_take_coda_config_defaults(tmp_path):
    folder, _, _ = write_coda(tmp_path / "coda")
    raw = json.loads((folder / "config.json").read_text())
    for key in ("rope_theta", "rms_norm_eps", "mask_token_id"):
        raw.pop(key)
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = HookedMDM.from_pretrained(folder).cfg
    assert cfg.rope_theta == 1e6 and cfg.norm_eps == 1e-6
    assert cfg.mask_token_id is None  # CoDA's 151669 is outside this vocabulary and added_tokens.json is not read
