"""Nemotron-Labs-Diffusion (`NemotronLabsDiffusionModel`, `model_type: nemotron_labs_diffusion`) → HookedMDM.

NVIDIA's hub modeling file is remote code that is not in any public repository; this transcription follows the vLLM
port (`vllm/model_executor/models/nemotron_dllm.py` @ 86cd302f) and a third-party copy of the hub files (config
class defaults, weight names), see `shared/specs/families-2.md` §9:

* Backbone = Ministral-3 (Llama-like): pre-RMSNorm, GQA without biases or q/k norms, SiLU-gated MLP; weights under
  `encoder.` (`encoder.embed_tokens`, `encoder.layers.{i}.self_attn.{q,k,v,o}_proj`, `encoder.norm`) and an untied
  head `diffusion_head.weight` that serves both modes.
* RoPE from `rope_parameters` (the released configs: yarn, factor 0.25 over 16384 original positions, attention
  factor 1), then the llama-4 query scale `1 + beta * log(1 + floor(p / original))` after the rotation
  (`mdm_lens.rotary`); no `llama_4_scaling_beta`: no query scale (as vLLM; the hub file would fail).
* Diffusion mode (`dlm_paradigm "bidirectional"`): bidirectional attention over the input, logit i predicts token
  i (unshifted). The autoregressive mode of the same weights (the samplers' prefill and commit forwards, `ar`) runs
  the causal mask and reads logit i as the prediction of token i+1 (`mdm_lens.diffusion.nemotron`).
  `dlm_paradigm "autoregressive"` makes every forward causal (`cfg.attention = "causal"`). `"block_diff"` (a
  training layout: `[x_t; x_0]` halves under a flex mask) is refused.

Absent keys take `NemotronLabsDiffusionConfig`'s defaults (`REFERENCE_DEFAULTS`). `mask_token_id` -1 (the class
default) means none: the tokenizer files are asked, else `cfg.mask_token_id` stays None and the diffusion samplers
refuse. `block_size` is the samplers' default block length (`cfg.extra["dlm_block_size"]`): it is not an attention
mask of the diffusion-mode forward, which sees the whole input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan

ARCHITECTURE, MODEL_TYPE, FAMILY = "NemotronLabsDiffusionModel", "nemotron_labs_diffusion", "nemotron_dllm"
REFERENCE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": None, "tie_word_embeddings": False, "rope_theta": 1e6, "rope_parameters": None,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None, "mask_token_id": -1,
    "dlm_paradigm": "bidirectional", "block_size": 32,
}
PARADIGMS = ("bidirectional", "autoregressive", "block_diff")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _refuse_unsupported(get: Any) -> None:
    if get("hidden_act") != "silu":
        raise ConfigError(f"hidden_act={get('hidden_act')!r}: Nemotron-Labs-Diffusion runs a SiLU-gated MLP only.")
    for key in ("attention_bias", "mlp_bias"):
        if get(key):
            raise ConfigError(f"{key}=true: the Ministral-3 backbone has no biases (its projections are built with "
                              "bias=False); a biased Nemotron checkpoint is not one this loader can run exactly.")
    if get("sliding_window") is not None:
        raise ConfigError(f"sliding_window={get('sliding_window')!r}: sliding-window attention is not implemented; "
                          "refusing rather than attend further than the reference.")
    if get("dlm_paradigm") not in PARADIGMS[:2]:
        raise ConfigError(f"dlm_paradigm={get('dlm_paradigm')!r}: mdm_lens runs 'bidirectional' (diffusion) and "
                          "'autoregressive' checkpoints; 'block_diff' is a training layout ([x_t; x_0] under a flex "
                          f"mask) whose inference forward is not public. Expected one of {PARADIGMS[:2]}.")


def rope_of(config: dict[str, Any], get: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict for `mdm_lens.rotary` or None) from `rope_parameters` (the config class mirrors
    `rope_theta` from it and sets `rope_scaling` to the same dict)."""
    params = get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters={params!r}: expected a JSON object of rotary settings or null.")
    legacy = config.get("rope_scaling")
    if legacy is not None and legacy != params:
        raise ConfigError(f"config.json has rope_scaling={legacy!r} and rope_parameters={params!r}; the config class "
                          "replaces rope_scaling with rope_parameters. Remove rope_scaling or make them equal.")
    params = dict(params or {})
    theta = params.get("rope_theta", get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_parameters.rope_type={kind!r} is not implemented (expected one of {ROPE_TYPES}).")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']!r}: partial rotary "
                          "embeddings are not implemented for this family.")
    _numbers(params, theta)
    beta = params.get("llama_4_scaling_beta")
    if kind == "default" and beta is None:
        return float(theta), None
    # transformers fills the yarn length from max_position_embeddings; vLLM's query scale does the same
    original = params.get("original_max_position_embeddings", get("max_position_embeddings"))
    scaling = {"rope_type": kind, "original_max_position_embeddings": float(original)}
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "low_freq_factor", "high_freq_factor", "llama_4_scaling_beta"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    if "truncate" in params:
        scaling["truncate"] = bool(params["truncate"])
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": ("factor",)}.get(kind, ())
    missing = [k for k in needs if k not in scaling]
    if missing:
        raise ConfigError(f"rope_parameters {params} (rope_type {kind!r}) lacks {missing}.")
    return float(theta), scaling


def _numbers(params: dict[str, Any], theta: Any) -> None:
    def finite_positive(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and 0 < v < float("inf")

    checks = {"rope_theta": theta, **{k: params[k] for k in ("factor", "original_max_position_embeddings",
                                                             "beta_fast", "beta_slow", "attention_factor")
                                      if params.get(k) is not None}}
    for key, value in checks.items():
        if not finite_positive(value):
            raise ConfigError(f"rope setting {key}={value!r} is invalid: expected a finite number > 0.")
    beta = params.get("llama_4_scaling_beta")
    if beta is not None and not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta == beta
                                 and abs(beta) < float("inf")):
        raise ConfigError(f"rope setting llama_4_scaling_beta={beta!r} is invalid: expected a finite number.")


def config_from_nemotron(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import in_vocab, mask_token_id

    def get(key: str) -> Any:
        return config[key] if key in config else REFERENCE_DEFAULTS[key]

    _refuse_unsupported(get)
    theta, scaling = rope_of(config, get)
    n_layers, n_heads = get("num_hidden_layers"), get("num_attention_heads")
    extra: dict[str, Any] = {"arch": FAMILY, "qk_norm": False, "o_bias": False, "moe_layers": [False] * n_layers,
                             "dlm_block_size": get("block_size"), "dlm_paradigm": get("dlm_paradigm")}
    if scaling:
        extra["rope_scaling"] = scaling
    vocab = get("vocab_size")
    cfg = MDMConfig(
        d_model=get("hidden_size"), n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, d_head=get("head_dim") or get("hidden_size") // n_heads,
        d_mlp=get("intermediate_size"), d_vocab=vocab, n_ctx=get("max_position_embeddings"), rope_theta=theta,
        norm_eps=float(get("rms_norm_eps")),
        attention="causal" if get("dlm_paradigm") == "autoregressive" else "bidirectional",
        rope_full_precision=False, tie_word_embeddings=bool(get("tie_word_embeddings")),
        pad_token_id=in_vocab(get("pad_token_id"), vocab), bos_token_id=in_vocab(get("bos_token_id"), vocab),
        family=FAMILY, model_name=name, extra=extra,
    )
    given = {k: v for k, v in config.items() if not (k == "mask_token_id" and v == -1)}  # -1: no mask token
    cfg.mask_token_id = mask_token_id(given, folder, vocab)
    return cfg


def nemotron_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    """The Llama-style layout under `encoder.`, and `diffusion_head.weight` for the unembedding."""
    from mdm_lens.loading.family_parts import hf_layout_plan

    plan = hf_layout_plan(cfg, bias=None, shared=None)
    rename = {"lm_head.weight": "diffusion_head.weight"}
    return {target: [rename.get(s, "encoder." + s.removeprefix("model.")) for s in sources]
            for target, sources in plan.items()}
