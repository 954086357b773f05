"""Nemotron-Labs-Diffusion loads from its hub layout without remote code and its forward matches the plain-torch
reference (tests/families/nemotron_fixture.py) in diffusion (bidirectional) and AR (causal) mode; every config key
the loader reads is exercised where it differs from the class default; unsupported values are refused."""

from __future__ import annotations

import json

import pytest
import torch
from nemotron_fixture import CONFIG, MASK_ID, reference_forward, reference_inv_freq, write_nemotron

from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError
from mdm_lens.rotary import yarn_inv_freq

TOKENS = torch.randint(0, MASK_ID, (2, 40), generator=torch.Generator().manual_seed(1))
CAUSAL = torch.tril(torch.ones(40, 40, dtype=torch.bool))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max())), float((got - want).abs().max())


def _load(tmp_path, **kw):
    folder, config, sd = write_nemotron(tmp_path / "ckpt", **kw)
    return HookedMDM.from_pretrained(str(folder)), config, sd


VARIANTS = {
    "released_layout": {},  # yarn factor 0.25 + llama-4 query scale past 16 positions, as the 3B config
    "yarn_attention_factor": dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                                        mscale=0.9, mscale_all_dim=0.4, truncate=False,
                                                        rope_theta=500.0)),
    "explicit_attention_factor": dict(rope_parameters=dict(rope_type="yarn", factor=2.0, attention_factor=1.3,
                                                            original_max_position_embeddings=12, rope_theta=900.0)),
    "plain_rope_with_q_scale": dict(rope_parameters=dict(rope_type="default", llama_4_scaling_beta=0.5,
                                                          original_max_position_embeddings=8, rope_theta=300.0)),
    "mha_and_eps": dict(num_key_value_heads=None, rms_norm_eps=0.01),
    "tied_head": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_the_reference_in_both_modes(tmp_path, variant):
    model, config, sd = _load(tmp_path, **VARIANTS[variant])
    ref, _ = reference_forward(sd, config, TOKENS)
    _close(model(TOKENS), ref)
    ref_ar, _ = reference_forward(sd, config, TOKENS, causal=True)
    _close(model(TOKENS, attn_mask=CAUSAL), ref_ar)
    assert (ref - ref_ar).abs().max() > 1e-2  # the two modes differ: the mask is not a no-op here


def test_absent_keys_take_the_config_class_defaults(tmp_path):
    drop = ("rope_parameters", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id",
            "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "dlm_paradigm", "block_size",
            "hidden_act")
    model, config, sd = _load(tmp_path, drop=drop, vocab_size=CONFIG["vocab_size"])
    cfg = model.cfg
    assert (cfg.rope_theta, cfg.norm_eps, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1e6, 1e-5, 1, 2,
                                                                                                    None)
    assert cfg.mask_token_id is None and cfg.extra["dlm_block_size"] == 32 and cfg.attention == "bidirectional"
    assert "rope_scaling" not in cfg.extra and not cfg.tie_word_embeddings
    ref, _ = reference_forward(sd, {**config, "rope_theta": 1e6, "rms_norm_eps": 1e-5}, TOKENS)
    _close(model(TOKENS), ref)


def test_config_facts_reach_the_model(tmp_path):
    model, _, _ = _load(tmp_path)
    cfg = model.cfg
    assert (cfg.family, cfg.d_head, cfg.n_kv_heads, cfg.n_ctx, cfg.norm_eps) == ("nemotron_dllm", 24, 2, 96, 1e-6)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id) == (100, 98, 96, 99)
    assert cfg.extra["dlm_block_size"] == 4 and cfg.rope_theta == 10000.0 and not cfg.logit_shift
    assert cfg.extra["rope_scaling"]["llama_4_scaling_beta"] == 0.3


def test_the_mask_id_minus_one_means_none_and_the_tokenizer_files_are_asked(tmp_path):
    folder, _, _ = write_nemotron(tmp_path / "ckpt", mask_token_id=-1)
    assert HookedMDM.from_pretrained(str(folder)).cfg.mask_token_id is None
    tok = {"added_tokens_decoder": {"77": {"content": "<|mask|>", "special": True}}, "mask_token": "<|mask|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    assert HookedMDM.from_pretrained(str(folder)).cfg.mask_token_id == 77


def test_autoregressive_paradigm_is_causal_everywhere(tmp_path):
    model, config, sd = _load(tmp_path, dlm_paradigm="autoregressive")
    assert model.cfg.attention == "causal"
    _close(model(TOKENS), reference_forward(sd, config, TOKENS, causal=True)[0])


@pytest.mark.parametrize("override, words", [
    (dict(attention_bias=True), "no biases"), (dict(mlp_bias=True), "no biases"),
    (dict(sliding_window=8), "sliding-window"), (dict(dlm_paradigm="block_diff"), "block_diff"),
    (dict(hidden_act="gelu"), "SiLU"), (dict(rope_parameters=dict(rope_type="longrope", factor=2.0)), "longrope"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_scaling"),
    (dict(rope_parameters=dict(rope_type="yarn")), "factor"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=-1.0)), "factor=-1.0"),
    (dict(mask_token_id=-2), "mask_token_id"), (dict(block_size=0), "block_size"),
])
def test_unsupported_values_are_refused_naming_the_key(tmp_path, override, words):
    folder, _, _ = write_nemotron(tmp_path / "ckpt", **override)
    with pytest.raises(ConfigError, match=words):
        HookedMDM.from_pretrained(str(folder))


def test_yarn_frequencies_match_the_transcription_of_transformers():
    for params in [CONFIG["rope_parameters"], VARIANTS["yarn_attention_factor"]["rope_parameters"]]:
        config = {**CONFIG, "rope_parameters": params}
        want, att = reference_inv_freq(config)
        scaling = {**params, "original_max_position_embeddings": float(params["original_max_position_embeddings"])}
        got, got_att = yarn_inv_freq(24, params["rope_theta"], scaling, torch.device("cpu"))
        assert torch.allclose(got, want, rtol=1e-6) and got_att == pytest.approx(att)
        assert not torch.allclose(got, 1.0 / params["rope_theta"] ** (torch.arange(0, 24, 2).float() / 24))


def test_ar_mode_matches_transformers_ministral3(tmp_path):
    """The reference's YaRN + llama-4 query scale, checked once against transformers' own Ministral-3 (causal)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Ministral3ForCausalLM"):
        pytest.skip("transformers without Ministral-3")
    folder, config, sd = write_nemotron(tmp_path / "ckpt")
    own = ("architectures", "model_type", "auto_map", "mask_token_id", "dlm_paradigm", "block_size")
    hf = transformers.Ministral3ForCausalLM(transformers.Ministral3Config(
        **{k: v for k, v in config.items() if k not in own})).eval()
    hf.load_state_dict({("model." + k.removeprefix("encoder.")) if k.startswith("encoder.") else "lm_head.weight": v
                        for k, v in sd.items()})
    with torch.no_grad():
        want = hf(TOKENS).logits
    _close(reference_forward(sd, config, TOKENS, causal=True)[0], want)
    _close(HookedMDM.from_pretrained(str(folder))(TOKENS, attn_mask=CAUSAL), want)


def test_hub_weight_names_are_required(tmp_path):
    folder, _, sd = write_nemotron(tmp_path / "ckpt")
    from safetensors.torch import save_file

    renamed = {("model." + k.removeprefix("encoder.")) if k.startswith("encoder.") else k: v for k, v in sd.items()}
    save_file({k: v.contiguous() for k, v in renamed.items()}, str(folder / "model.safetensors"))
    with pytest.raises(Exception, match="encoder"):
        HookedMDM.from_pretrained(str(folder))
