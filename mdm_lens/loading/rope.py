"""Rotary settings of a Llama / Qwen2 / Dream `config.json`, resolved as transformers 5 resolves the same file.

transformers (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` + `standardize_rope_params`) reads
the legacy `rope_scaling` key *instead of* `rope_parameters` whenever `rope_scaling` is a non-empty dict
(the two are never merged), then fills, without overwriting: `rope_theta` from the top-level key (10000
when absent), `rope_type` from the legacy `type` key ("default" when absent), and for the llama3 / yarn /
longrope types `original_max_position_embeddings` (a top-level key of that name wins over the dict's
own value; otherwise `max_position_embeddings`). `resolve_rope` returns that same dictionary, so a test
can compare it with `transformers.AutoConfig.from_pretrained(folder).rope_parameters` key for key.

Only plain rotary embeddings and the `linear` and `llama3` scalings are implemented by `HookedMDM`;
every other type (`dynamic`, `yarn`, `longrope`, …) is refused at load instead of run unscaled.
"""

from __future__ import annotations

import math
from typing import Any

from mdm_lens.errors import ConfigError

DEFAULT_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta
IMPLEMENTED = ("default", "linear", "llama3")
_NEEDS_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
_REQUIRED = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def resolve_rope(config: dict[str, Any], max_position_embeddings: Any) -> dict[str, Any]:
    """The standardised `rope_parameters` transformers builds from this config.json (a new dict)."""
    scaling = config.get("rope_scaling")
    chosen = scaling if scaling else config.get("rope_parameters")
    if chosen is None:
        chosen = {}
    if not isinstance(chosen, dict):
        key = "rope_scaling" if scaling else "rope_parameters"
        raise ConfigError(f"config.json has {key}={chosen!r}: expected a JSON object of rotary settings or null.")
    params = dict(chosen)
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"rope settings nested per layer type ({nested}) are not supported: mdm_lens runs one "
                          "rotary embedding for every layer.")
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _NEEDS_ORIGINAL_LENGTH:
        # a top-level key wins over the dict's own value: the rotary init functions standardise again once
        # the extra config.json keys are attributes (`AutoConfig`'s rope_parameters shows the dict's value
        # until the model is built, but the model runs the top-level one)
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", max_position_embeddings)
    return params


def _number(params: dict[str, Any], key: str, source: str, *, above: float = 0.0) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= above:
        raise ConfigError(f"{source}: rope setting {key}={value!r} is invalid: expected a finite number > {above:g}"
                          f" (resolved rope settings: {params}).")
    return float(value)


def rope_settings(config: dict[str, Any], family: str, max_position_embeddings: Any
                  ) -> tuple[float, dict[str, Any] | None]:
    """`(theta, scaling)` for HookedMDM: scaling is None for plain rotary embeddings, else the float
    parameters of a `linear` or `llama3` scaling. Anything HookedMDM would not run exactly is refused."""
    if family == "dream":
        return _dream_rope(config)
    params = resolve_rope(config, max_position_embeddings)
    source = "rope_scaling" if config.get("rope_scaling") else (
        "rope_parameters" if config.get("rope_parameters") else "rope_theta")
    kind = params["rope_type"]
    theta = _number(params, "rope_theta", source)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor={params['partial_rotary_factor']!r} (partial rotary embeddings) "
                          "is not implemented; mdm_lens rotates the whole head.")
    if kind not in IMPLEMENTED:
        raise ConfigError(f"rope type {kind!r} (resolved from {source}: {params}) is not implemented; mdm_lens "
                          "supports plain rotary embeddings and the 'linear' and 'llama3' scalings. It refuses "
                          "rather than run different positions than the reference.")
    if kind == "default":
        return theta, None
    if family == "qwen2" and kind == "llama3":
        raise ConfigError(f"rope type {kind!r} is not one a {family} checkpoint uses; refusing to guess.")
    missing = [k for k in _REQUIRED[kind] if k not in params]
    if missing:
        raise ConfigError(f"rope scaling {params} (from {source}) lacks {missing}.")
    values = {k: _number(params, k, source) for k in _REQUIRED[kind]}
    if kind == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {params} (from "
                          f"{source}); transformers refuses this too.")
    return theta, {"rope_type": kind, **values}


def _dream_rope(config: dict[str, Any]) -> tuple[float, None]:
    """Dream's own `DreamConfig` keeps `rope_theta` (reference default 10000) and `rope_scaling`; its
    modeling code only runs the plain rotary embedding, so any scaling is refused."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json has {key}={value!r}: expected a JSON object of rotary settings or null.")
        kind = (value or {}).get("rope_type") or (value or {}).get("type") or "default"
        if kind != "default":
            raise ConfigError(f"rope type {kind!r} ({key}={value}) is not one a dream checkpoint uses; refusing "
                              "to guess.")
    theta = _number({"rope_theta": config.get("rope_theta", DEFAULT_THETA)}, "rope_theta", "config.json")
    inner = (config.get("rope_parameters") or {}).get("rope_theta")
    if inner is not None and inner != theta:
        raise ConfigError(f"Dream config has rope_theta={theta} and rope_parameters.rope_theta={inner}, which "
                          "disagree; DreamConfig reads rope_theta. Remove one of them.")
    return theta, None
