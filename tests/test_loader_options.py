"""Every loader option of each family's real config.json, with a case whose logits change if the option
were ignored: each checkpoint is compared with transformers' Llama/Qwen2 holding the same weights (non-causal
for the MDMs), and the same weights read *without* the option give different logits (or a loud error).
Absent keys must mean the reference's default, not the released 8B/7B values."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from mdm_lens import CheckpointError, ConfigError, HookedMDM
from mdm_lens.loading.hf import REFERENCE_DEFAULTS as HF_DEFAULTS
from mdm_lens.loading.llada import REFERENCE_DEFAULTS as LLADA_DEFAULTS
from tiny_checkpoints import hf_reference, write_dream, write_hf, write_llada

TOL = 1e-4
CHANGED = 1e-3  # an ignored option moves the logits by far more than this


def ref_logits(ref, tokens, causal: bool, shift: bool = False):
    with torch.no_grad():
        out = ref(tokens, is_causal=causal).logits
    return torch.cat([out[:, :1], out[:, :-1]], dim=1) if shift else out


def ours(folder, tokens, **kw):
    model = HookedMDM.from_pretrained(str(folder), **kw)
    with torch.no_grad():
        return model, model(tokens, return_type="aligned")


def edit_config(folder, drop=(), **set_):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(set_)
    path.write_text(json.dumps(cfg))


def close(a, b):
    return (a - b).abs().max().item() <= TOL


def far(a, b):
    return a.shape != b.shape or (a - b).abs().max().item() > CHANGED


TOKENS = torch.randint(2, 90, (2, 11), generator=torch.Generator().manual_seed(5))


# --- reference defaults ------------------------------------------------------------------------------
def test_llama_and_qwen2_defaults_are_transformers_own():
    for family, cls in (("llama", LlamaConfig), ("qwen2", Qwen2Config)):
        ref = cls()
        theta = (ref.rope_parameters or {}).get("rope_theta")
        d = HF_DEFAULTS[family]
        assert d["rope_theta"] == theta == 10000.0
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act"):
            assert d[key] == getattr(ref, key), (family, key)
        kv = d["num_key_value_heads"]
        assert (kv if kv is not None else d["num_attention_heads"]) == ref.num_key_value_heads


def test_llada_and_dream_defaults_are_the_reference_classes():
    """Values read from configuration_llada.ModelConfig and configuration_dream.DreamConfig."""
    assert LLADA_DEFAULTS["weight_tying"] is True and LLADA_DEFAULTS["rope_theta"] == 10000.0
    assert LLADA_DEFAULTS["embedding_size"] == 50304 and LLADA_DEFAULTS["max_sequence_length"] == 1024
    assert LLADA_DEFAULTS["rms_norm_eps"] == 1e-5 and LLADA_DEFAULTS["rope"] is False
    d = HF_DEFAULTS["dream"]
    assert d["rope_theta"] == 10000.0 and d["num_key_value_heads"] == 32 and d["rms_norm_eps"] == 1e-6
    assert d["mask_token_id"] == 151666 and d["tie_word_embeddings"] is False


# --- LLaDA -------------------------------------------------------------------------------------------
def test_llada_weight_tying_true_and_absent_mean_tied(tmp_path):
    ref = hf_reference("llada", tie_word_embeddings=True)
    want = ref_logits(ref, TOKENS, causal=False)
    folder = write_llada(ref, tmp_path / "tied")
    model, got = ours(folder, TOKENS)
    assert model.unembed.weight is model.embed.W_E and close(got, want)
    edit_config(folder, drop=["weight_tying"])  # the reference default is True
    model, got = ours(folder, TOKENS)
    assert model.cfg.tie_word_embeddings and close(got, want)
    edit_config(folder, weight_tying=False)  # ignoring the tie would need an ff_out the files lack
    with pytest.raises(CheckpointError, match="weight_tying"):
        HookedMDM.from_pretrained(str(folder))


def test_llada_untied_checkpoint_without_weight_tying_key_is_a_loud_error(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "untied", drop_keys=("weight_tying",))
    with pytest.raises(CheckpointError, match=r"unexpected.*ff_out.*weight_tying"):
        HookedMDM.from_pretrained(str(folder))


def test_llada_include_qkv_bias(tmp_path):
    ref = hf_reference("dream")  # a non-causal Qwen2: q/k/v biases, no o bias = LLaDA with include_qkv_bias
    folder = write_llada(ref, tmp_path / "bias")
    assert json.loads((folder / "config.json").read_text())["include_qkv_bias"] is True
    model, got = ours(folder, TOKENS)
    assert model.cfg.qkv_bias and close(got, ref_logits(ref, TOKENS, causal=False))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv_bias.zero_()
        assert far(model(TOKENS), got)  # the biases matter on these weights
    edit_config(folder, include_qkv_bias=False)
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("n_kv, mqa, expect", [(4, None, 4), (2, None, 2), (1, None, 1), (None, True, 1),
                                               (None, None, 4), (None, False, 4), (1, True, 1), (4, False, 4)])
def test_llada_kv_heads_and_multi_query_attention(tmp_path, n_kv, mqa, expect):
    ref = hf_reference("llada", n_kv_heads=expect)
    folder = write_llada(ref, tmp_path / "kv", config_overrides={"n_kv_heads": n_kv, "multi_query_attention": mqa})
    model, got = ours(folder, TOKENS)
    assert model.cfg.n_key_value_heads == expect and close(got, ref_logits(ref, TOKENS, causal=False))


@pytest.mark.parametrize("n_kv, mqa", [(2, True), (2, False), (4, True), (1, False)])
def test_llada_conflicting_mqa_and_kv_heads_are_refused(tmp_path, n_kv, mqa):
    folder = write_llada(hf_reference("llada", n_kv_heads=n_kv), tmp_path / "kv",
                         config_overrides={"multi_query_attention": mqa})
    with pytest.raises(ConfigError, match="multi_query_attention"):
        HookedMDM.from_pretrained(str(folder))


def test_llada_rope_theta_absent_is_10000(tmp_path):
    ref = hf_reference("llada", rope_theta=10000.0)
    folder = write_llada(ref, tmp_path / "theta", drop_keys=("rope_theta",))
    model, got = ours(folder, TOKENS)
    assert model.cfg.rope_theta == 10000.0 and close(got, ref_logits(ref, TOKENS, causal=False))
    edit_config(folder, rope_theta=500000.0)  # the released value would be a different model
    assert far(ours(folder, TOKENS)[1], got)


def test_llada_rms_norm_eps(tmp_path):
    ref = hf_reference("llada", rms_norm_eps=0.05)
    folder = write_llada(ref, tmp_path / "eps")
    model, got = ours(folder, TOKENS)
    assert model.cfg.norm_eps == 0.05 and close(got, ref_logits(ref, TOKENS, causal=False))
    edit_config(folder, drop=["rms_norm_eps"])  # default 1e-5
    assert far(ours(folder, TOKENS)[1], got)


def test_llada_embedding_size_larger_than_vocab(tmp_path):
    """LLaDA's logits are `embedding_size` wide (the reference never slices them to vocab_size)."""
    ref = hf_reference("llada", vocab_size=100)
    folder = write_llada(ref, tmp_path / "emb", config_overrides={"vocab_size": 97, "embedding_size": 100})
    model, got = ours(folder, TOKENS)
    assert got.shape[-1] == 100 and model.cfg.extra["vocab_size"] == 97
    assert close(got, ref_logits(ref, TOKENS, causal=False))
    edit_config(folder, drop=["embedding_size"])  # reference default 50304: the weights do not fit
    with pytest.raises(CheckpointError, match="shape mismatch"):
        HookedMDM.from_pretrained(str(folder))
    edit_config(folder, embedding_size=None)  # explicit null: embedding_size = vocab_size = 97
    with pytest.raises(CheckpointError, match="shape mismatch"):
        HookedMDM.from_pretrained(str(folder))
    edit_config(folder, embedding_size=90)
    with pytest.raises(ConfigError, match="smaller than vocab_size"):
        HookedMDM.from_pretrained(str(folder))


def test_llada_mlp_ratio_when_mlp_hidden_size_is_absent(tmp_path):
    ref = hf_reference("llada", intermediate_size=4 * 64)
    folder = write_llada(ref, tmp_path / "ratio", drop_keys=("mlp_hidden_size",), config_overrides={"mlp_ratio": 4})
    model, got = ours(folder, TOKENS)
    assert model.cfg.d_mlp == 256 and close(got, ref_logits(ref, TOKENS, causal=False))
    edit_config(folder, drop=["mlp_ratio"])  # reference default 4: same
    assert close(ours(folder, TOKENS)[1], got)


def test_llada_max_sequence_length_default(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "ctx", drop_keys=("max_sequence_length",))
    assert HookedMDM.from_pretrained(str(folder)).cfg.n_ctx == 1024


def test_llada_rope_full_precision_matters_in_bf16(tmp_path):
    folder = write_llada(hf_reference("llada"), tmp_path / "rfp")
    full = HookedMDM.from_pretrained(str(folder), dtype="bfloat16")
    edit_config(folder, rope_full_precision=False)
    low = HookedMDM.from_pretrained(str(folder), dtype="bfloat16")
    assert full.cfg.rope_full_precision and not low.cfg.rope_full_precision
    tokens = torch.randint(2, 90, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache_full = full.run_with_cache(tokens, names_filter="blocks.0.attn.hook_rot_q")
        _, cache_low = low.run_with_cache(tokens, names_filter="blocks.0.attn.hook_rot_q")
    assert not torch.equal(cache_full["blocks.0.attn.hook_rot_q"], cache_low["blocks.0.attn.hook_rot_q"])


@pytest.mark.parametrize("key, value", [("scale_logits", True), ("input_emb_norm", True), ("include_bias", True),
                                        ("alibi", True), ("attention_layer_norm", True), ("block_group_size", 2),
                                        ("layer_norm_type", "default"), ("rope", False),
                                        ("layer_norm_with_affine", False), ("bias_for_layer_norm", True)])
def test_llada_unsupported_options_are_refused(tmp_path, key, value):
    folder = write_llada(hf_reference("llada"), tmp_path / "x", config_overrides={key: value})
    with pytest.raises(ConfigError, match=key):
        HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("key", ["activation_type", "block_type", "layer_norm_type", "rope"])
def test_llada_absent_architecture_keys_take_the_reference_default_and_are_refused(tmp_path, key):
    """ModelConfig defaults to swiglu / sequential / LayerNorm / no rope: a different network, never run."""
    folder = write_llada(hf_reference("llada"), tmp_path / "x", drop_keys=(key,))
    with pytest.raises(ConfigError, match=rf"{key}.*absent from config.json"):
        HookedMDM.from_pretrained(str(folder))


# --- Dream -------------------------------------------------------------------------------------------
def test_dream_rope_theta_absent_is_10000_not_1e6(tmp_path):
    ref = hf_reference("dream", rope_theta=10000.0)
    folder = write_dream(ref, tmp_path / "d", drop_keys=("rope_theta",))
    model, got = ours(folder, TOKENS)
    assert model.cfg.rope_theta == 10000.0
    assert close(got, ref_logits(ref, TOKENS, causal=False, shift=True))
    edit_config(folder, rope_theta=1e6)
    assert far(ours(folder, TOKENS)[1], got)


def test_dream_tied_embeddings(tmp_path):
    ref = hf_reference("dream", tie_word_embeddings=True)
    folder = write_dream(ref, tmp_path / "d")
    model, got = ours(folder, TOKENS)
    assert model.unembed.weight is model.embed.W_E
    assert close(got, ref_logits(ref, TOKENS, causal=False, shift=True))


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_dream_kv_heads(tmp_path, n_kv):
    ref = hf_reference("dream", n_kv_heads=n_kv)
    model, got = ours(write_dream(ref, tmp_path / "d"), TOKENS)
    assert model.cfg.n_key_value_heads == n_kv and close(got, ref_logits(ref, TOKENS, causal=False, shift=True))


def test_dream_absent_kv_heads_is_32(tmp_path):
    folder = write_dream(hf_reference("dream"), tmp_path / "d", drop_keys=("num_key_value_heads",))
    with pytest.raises(ConfigError, match="num_key_value_heads=32"):
        HookedMDM.from_pretrained(str(folder))


def test_dream_rms_norm_eps(tmp_path):
    ref = hf_reference("dream", rms_norm_eps=0.05)
    folder = write_dream(ref, tmp_path / "d")
    _, got = ours(folder, TOKENS)
    assert close(got, ref_logits(ref, TOKENS, causal=False, shift=True))
    edit_config(folder, drop=["rms_norm_eps"])
    assert far(ours(folder, TOKENS)[1], got)


def test_dream_head_dim_is_derived_as_the_reference_does(tmp_path):
    ref = hf_reference("dream")
    folder = write_dream(ref, tmp_path / "d", config_overrides={"head_dim": 8})
    with pytest.warns(UserWarning, match="head_dim=8.*ignores"):
        model, got = ours(folder, TOKENS)
    assert model.cfg.d_head == 16 and close(got, ref_logits(ref, TOKENS, causal=False, shift=True))


def test_dream_ignores_what_its_reference_ignores(tmp_path):
    """attention_bias / mlp_bias are not read by DreamAttention / DreamMLP; SDPA ignores the sliding window."""
    ref = hf_reference("dream")
    want = ref_logits(ref, TOKENS, causal=False, shift=True)
    folder = write_dream(ref, tmp_path / "d", config_overrides={"attention_bias": False, "mlp_bias": True})
    assert close(ours(folder, TOKENS)[1], want)
    edit_config(folder, use_sliding_window=True, sliding_window=4)
    with pytest.warns(UserWarning, match="sliding"):
        assert close(ours(folder, TOKENS)[1], want)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_dream_rope_scaling_is_refused(tmp_path, scaling):
    folder = write_dream(hf_reference("dream"), tmp_path / "d", config_overrides={"rope_scaling": scaling})
    with pytest.raises(ConfigError, match="rope type"):
        HookedMDM.from_pretrained(str(folder))


# --- Llama / Qwen2 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_tied_embeddings(tmp_path, family):
    ref = hf_reference(family, tie_word_embeddings=True)
    model, got = ours(write_hf(ref, tmp_path / family), TOKENS)
    assert model.unembed.weight is model.embed.W_E and close(got, ref_logits(ref, TOKENS, causal=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_rope_theta_absent_is_10000(tmp_path, family):
    ref = hf_reference(family, rope_theta=10000.0)
    folder = write_hf(ref, tmp_path / family)
    edit_config(folder, drop=["rope_theta", "rope_parameters", "rope_scaling"])
    model, got = ours(folder, TOKENS)
    assert model.cfg.rope_theta == 10000.0 and close(got, ref_logits(ref, TOKENS, causal=True))
    edit_config(folder, rope_theta=1e6)
    assert far(ours(folder, TOKENS)[1], got)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_head_dim_other_than_hidden_over_heads(tmp_path, family):
    ref = hf_reference(family, head_dim=8)
    model, got = ours(write_hf(ref, tmp_path / family), TOKENS)
    assert model.cfg.d_head == 8 and close(got, ref_logits(ref, TOKENS, causal=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("n_kv", [1, 4])
def test_hf_mqa_and_mha(tmp_path, family, n_kv):
    ref = hf_reference(family, n_kv_heads=n_kv)
    model, got = ours(write_hf(ref, tmp_path / family), TOKENS)
    assert model.cfg.n_key_value_heads == n_kv and close(got, ref_logits(ref, TOKENS, causal=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_rms_norm_eps(tmp_path, family):
    ref = hf_reference(family, rms_norm_eps=0.05)
    folder = write_hf(ref, tmp_path / family)
    _, got = ours(folder, TOKENS)
    assert close(got, ref_logits(ref, TOKENS, causal=True))
    edit_config(folder, rms_norm_eps=1e-6)
    assert far(ours(folder, TOKENS)[1], got)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
])
def test_llama_rope_scaling_matches_transformers(tmp_path, scaling):
    ref = hf_reference("llama", rope_parameters={"rope_type": scaling["rope_type"], "rope_theta": 500000.0,
                                                 **{k: v for k, v in scaling.items() if k != "rope_type"}})
    tokens = torch.randint(2, 90, (2, 40), generator=torch.Generator().manual_seed(2))
    folder = write_hf(ref, tmp_path / "llama")
    model, got = ours(folder, tokens)
    assert model.cfg.extra["rope_scaling"]["rope_type"] == scaling["rope_type"]
    assert close(got, ref_logits(ref, tokens, causal=True))
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert far(ours(folder, tokens)[1], got)


def test_llama_attention_bias_and_mlp_bias_are_refused(tmp_path):
    ref = hf_reference("llama", attention_bias=True)
    with pytest.raises(ConfigError, match="o_proj"):
        HookedMDM.from_pretrained(str(write_hf(ref, tmp_path / "b")))
    ref = hf_reference("llama", mlp_bias=True)
    with pytest.raises(ConfigError, match="mlp_bias"):
        HookedMDM.from_pretrained(str(write_hf(ref, tmp_path / "m")))


def test_qwen2_sliding_window_and_unknown_rope_scaling_are_refused(tmp_path):
    folder = write_hf(hf_reference("qwen2"), tmp_path / "q")
    edit_config(folder, use_sliding_window=True)
    with pytest.raises(ConfigError, match="sliding"):
        HookedMDM.from_pretrained(str(folder))
    edit_config(folder, use_sliding_window=False, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                   "rope_theta": 1e6})
    with pytest.raises(ConfigError, match="yarn"):
        HookedMDM.from_pretrained(str(folder))


# --- rotary settings resolved as transformers resolves the same config.json ----------------------------
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_VARIANTS = {
    "absent": {},
    "only_rope_theta": {"rope_theta": 5e5},
    "legacy_linear": {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "legacy_llama3": {"rope_theta": 5e5, "rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 64}},
    "llama3_without_original_length": {"rope_theta": 5e5, "rope_scaling": dict(_LLAMA3)},
    "llama3_top_level_original_length": {"rope_scaling": dict(_LLAMA3), "original_max_position_embeddings": 32},
    "legacy_dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "legacy_yarn": {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "rope_parameters_only": {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e5}},
    "rope_parameters_theta_outside": {"rope_theta": 7e5, "rope_parameters": {"rope_type": "linear", "factor": 3.0}},
    # the bug this fixes: both keys, rope_scaling wins whole (transformers scales; we used to run unscaled)
    "both_scaling_wins": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "both_llama3_over_linear": {"rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 64},
                                "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}},
    "both_null_scaling": {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                                    "rope_theta": 1e4}},
    "empty_scaling": {"rope_theta": 5e5, "rope_scaling": {}},
    "type_and_rope_type": {"rope_scaling": {"type": "linear", "rope_type": "default", "factor": 2.0}},
    "theta_inside_scaling": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 9e4}},
}


def _rope_folder(tmp_path, family, variant):
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    raw = {"architectures": [arch], "model_type": family, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
           "max_position_embeddings": 256, **ROPE_VARIANTS[variant]}
    folder = tmp_path / f"{family}-{variant}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, raw


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_settings_resolve_as_transformers_resolves_them(tmp_path, family, variant):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from mdm_lens.loading import read_config
    from mdm_lens.loading.rope import resolve_rope

    folder, raw = _rope_folder(tmp_path, family, variant)
    theirs = AutoConfig.from_pretrained(str(folder))
    # what the model runs: its rotary init standardises again, once extra config.json keys are attributes
    theirs.standardize_rope_params()
    assert resolve_rope(raw, raw["max_position_embeddings"]) == theirs.rope_parameters
    kind = theirs.rope_parameters["rope_type"]
    if kind in ("dynamic", "yarn") or (family == "qwen2" and kind == "llama3"):
        with pytest.raises(ConfigError, match=f"rope type '{kind}'"):
            read_config(folder, family, None)
        return
    cfg, _ = read_config(folder, family, None)
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (cfg.extra.get("rope_scaling") or {"rope_type": "default"})["rope_type"] == kind
    positions = torch.arange(300)[None]  # past original_max_position_embeddings, where llama3 differs most
    with torch.device("meta"):
        model = HookedMDM(cfg)
    cos, sin = model._rotary(positions, arange=True)
    want_cos, want_sin = LlamaRotaryEmbedding(theirs)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.allclose(cos[:, :, 0], want_cos, rtol=0, atol=1e-5)
    assert torch.allclose(sin[:, :, 0], want_sin, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [{"rope_theta": None}, {"rope_theta": -1.0}, {"rope_theta": "1e4"},
                                 {"rope_scaling": {"rope_type": "linear", "factor": None}},
                                 {"rope_scaling": {"rope_type": "linear", "factor": 0}}])
def test_rope_values_are_checked_at_load(tmp_path, bad):
    from mdm_lens.loading import read_config

    folder, raw = _rope_folder(tmp_path, "llama", "absent")
    (folder / "config.json").write_text(json.dumps({**raw, **bad}))
    with pytest.raises(ConfigError, match="rope_theta|factor"):
        read_config(folder, "llama", None)
