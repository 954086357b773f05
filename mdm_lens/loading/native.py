"""Checks of our own `config.json` (`model_type: mdm_lens`, written by `save_pretrained`) before and after
`MDMConfig.from_dict`.

HF configs are checked key by key in `values.py`; the native format used to be trusted, so a hand edit reached
the model unchecked: `"extra": null` crashed with an AttributeError, `"dtype": "float128"` with torch's own,
an odd `extra.rotary_dim` or an unknown `rope_scaling` type at the first forward, and the TransformerLens
constants (`normalization_type`, `act_fn`, …) were loaded as given while the model still computes RMSNorm / SiLU /
rotary / MLP, so TL's cache helpers silently read the wrong convention. Each is a `ConfigError` naming the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig, check_extra_ints, check_tl_constants
from mdm_lens.errors import ConfigError
from mdm_lens.loading.rope import _REQUIRED as ROPE_KEYS
from mdm_lens.qk_attention import FAMILY_ARCHES

#: `extra` keys that change the blocks, which only the family blocks (`extra.arch`) build (qk_attention.py)
FAMILY_ONLY = ("qk_norm", "o_bias", "clip_qkv", "moe", "moe_layers")


def check_native_raw(raw: dict[str, Any], path: Path) -> None:
    """The keys `MDMConfig.from_dict` would take unchecked: `extra`, `dtype` and the TL constants."""
    extra = raw.get("extra", {})
    if not isinstance(extra, dict):
        raise ConfigError(f"{path}: extra={extra!r} is invalid: expected a JSON object (dict) of family facts.")
    check_extra_ints(extra, f"{path}: ")
    check_tl_constants(raw, f"{path}: ")


def check_native_extra(cfg: MDMConfig, path: Path) -> None:
    """`extra`'s structural keys against what the blocks build (after the sizes are known)."""
    extra, family = cfg.extra, cfg.extra.get("arch")
    if family is not None and family not in FAMILY_ARCHES:
        raise ConfigError(f"{path}: extra.arch={family!r} is invalid: expected one of {FAMILY_ARCHES} or absent.")
    if family is None:
        built = [k for k in FAMILY_ONLY if extra.get(k)]
        if built:
            raise ConfigError(f"{path}: extra.{built[0]}={extra[built[0]]!r} is only built by the family blocks "
                              f"(extra.arch in {FAMILY_ARCHES}); this model's plain blocks would ignore it.")
    _check_rotary_dim(extra.get("rotary_dim"), cfg.d_head, family is not None, path)
    _check_rope_scaling(extra.get("rope_scaling"), path)
    layers = extra.get("moe_layers")
    if family is not None and layers is not None and (not isinstance(layers, list) or len(layers) != cfg.n_layers):
        raise ConfigError(f"{path}: extra.moe_layers={layers!r} is invalid: expected a list of {cfg.n_layers} "
                          "true/false flags (one per layer).")
    clip = extra.get("clip_qkv")
    if clip is not None and not _positive(clip):
        raise ConfigError(f"{path}: extra.clip_qkv={clip!r} is invalid: expected a finite number > 0 or null.")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_rotary_dim(dim: Any, d_head: int, partial_ok: bool, path: Path) -> None:
    if dim is None:
        return
    ok = isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 and dim % 2 == 0 and dim <= d_head
    if not ok or (not partial_ok and dim != d_head):
        allowed = f"an even int in (0, d_head={d_head}]" if partial_ok else f"d_head={d_head} (plain blocks rotate " \
                                                                             "the whole head)"
        raise ConfigError(f"{path}: extra.rotary_dim={dim!r} is invalid: expected {allowed}.")


# the scalings HookedMDM implements, as its loaders write them into cfg.extra: the HF-style families' (loading.rope)
# and Nemotron's yarn and llama-4 query scale (a "default" table with llama_4_scaling_beta), so a saved Nemotron
# folder loads back
NATIVE_ROPE = {**ROPE_KEYS, "yarn": ("factor", "original_max_position_embeddings"),
               "default": ("original_max_position_embeddings", "llama_4_scaling_beta")}


def _check_rope_scaling(scaling: Any, path: Path) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in NATIVE_ROPE:
        raise ConfigError(f"{path}: extra.rope_scaling={scaling!r} is invalid: expected null or an object with "
                          f"rope_type one of {tuple(NATIVE_ROPE)} (the scalings HookedMDM implements).")
    bad = [k for k in NATIVE_ROPE[kind] if not _positive(scaling.get(k))]
    if bad:
        raise ConfigError(f"{path}: extra.rope_scaling ({kind}) needs {list(NATIVE_ROPE[kind])} as finite numbers > 0; "
                          f"{bad[0]}={scaling.get(bad[0])!r}.")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"{path}: extra.rope_scaling needs high_freq_factor > low_freq_factor, got {scaling}.")
