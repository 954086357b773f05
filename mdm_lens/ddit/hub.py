"""Loading BD3LM (`kuleshov-group/bd3lm-owt-block_size{4,8,16}`) and GIDD-DiT (`dvruette/gidd-*`) from their hub
layouts into `HookedBD3LM` / `HookedGIDD`. Keys config.json lacks take the hub config classes' defaults
(`BD3LMConfig`: cond_dim 129, block_size 1, attn_backend "flex"; `DITConfig`: max_seq_len 1024, …).

Weights: BD3LM is `backbone.` + the DDiT names, `backbone.rotary_emb.inv_freq`, and the top-level buffers
`sampling_eps_min` / `sampling_eps_max` (with `var_min`); GIDD has no prefix and persistent
`rotary_emb.cos_cached` / `sin_cached` `[1, max_seq_len, 3, 1, d_head]` (checked against the formula, unused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.ddit.config import check_mask_key, ddit_config
from mdm_lens.ddit.loading import PLACEMENT, _dtype, ddit_plan, load_weights, research_family
from mdm_lens.errors import ArgumentTypeError, CheckpointError, ConfigError
from mdm_lens.loading.values import check_raw, is_bool, positive_int, rate, time_margin, unit_interval


BD3LM_DEFAULTS: dict[str, Any] = dict(block_size=1, vocab_size=50258, model_length=1024, cross_attn=True, adaln=True,
                                      attn_backend="flex", causal=False, hidden_dim=768, cond_dim=129, n_blocks=12,
                                      n_heads=12, dropout=0.1, time_conditioning=False, var_min=True,
                                      sampling_eps_min=1e-3, sampling_eps_max=0.999)
GIDD_DEFAULTS: dict[str, Any] = dict(vocab_size=50258, max_seq_len=1024, hidden_size=768, timestep_cond_dim=128,
                                     num_hidden_layers=12, num_attention_heads=12, attention_dropout=0.0,
                                     p_uniform=0.0, t_eps=1e-4)
SCHEMA = {k: positive_int for k in ("block_size", "vocab_size", "model_length", "hidden_dim", "cond_dim", "n_blocks",
                                    "n_heads", "max_seq_len", "hidden_size", "timestep_cond_dim", "num_hidden_layers",
                                    "num_attention_heads")}
SCHEMA.update({k: is_bool for k in ("cross_attn", "adaln", "causal", "time_conditioning", "var_min")})
# values inference does not use are checked too: a dropout of 2.0 or a reversed eps interval is a broken config
SCHEMA.update({k: rate for k in ("dropout", "attention_dropout", "p_uniform")})
SCHEMA.update({k: unit_interval for k in ("sampling_eps_min", "sampling_eps_max")})
SCHEMA["t_eps"] = time_margin


def hub_family(folder: Path) -> str | None:
    """"bd3lm" / "gidd" for a folder holding one of them, else None."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    family = research_family(raw, Path(folder) / "config.json")
    return family if family in ("bd3lm", "gidd") else None


def _heads(path: Path, d: int, h: int) -> None:
    if d % h or (d // h) % 2:
        raise ConfigError(f"{path}: hidden size {d} must split into {h} heads of an even size (rotary).")


def bd3lm_config(raw: dict[str, Any], name: str, path: Path) -> MDMConfig:
    check_raw(raw, SCHEMA, path)
    v = {**BD3LM_DEFAULTS, **{k: raw[k] for k in BD3LM_DEFAULTS if k in raw}}
    for key, ok in (("cross_attn", True), ("adaln", True), ("causal", False)):
        if v[key] is not ok:
            raise ConfigError(f"{path}: {key}={v[key]} is not a released BD3LM layout (cross_attn true, adaln true, "
                              "causal false); it is not supported.")
    if v["attn_backend"] not in ("flex", "sdpa"):
        raise ConfigError(f"{path}: attn_backend={v['attn_backend']!r} is invalid: expected 'flex' or 'sdpa'.")
    if v["model_length"] % v["block_size"]:
        raise ConfigError(f"{path}: model_length={v['model_length']} is not a multiple of block_size="
                          f"{v['block_size']}.")
    _eps_interval(v["sampling_eps_min"], v["sampling_eps_max"], path)
    _heads(path, v["hidden_dim"], v["n_heads"])
    cfg = ddit_config("bd3lm", d_vocab=v["vocab_size"], n_ctx=v["model_length"], d_model=v["hidden_dim"],
                      cond_dim=v["cond_dim"], n_layers=v["n_blocks"], n_heads=v["n_heads"],
                      time_conditioning=v["time_conditioning"], model_name=name, dropout=v["dropout"],
                      block_size=v["block_size"], attn_backend=v["attn_backend"], var_min=v["var_min"],
                      sampling_eps_min=v["sampling_eps_min"], sampling_eps_max=v["sampling_eps_max"])
    cfg.mask_token_id = v["vocab_size"] - 1  # tokenizer.vocab_size (GPT-2) = vocab_size − 1, as MDLM
    cfg.extra["parameterization"] = "subs"
    check_mask_key(raw, cfg, path)
    return cfg


def _eps_interval(low: Any, high: Any, where: Any) -> None:
    """BD3LM's training clock [sampling_eps_min, sampling_eps_max]: numbers in [0, 1], not reversed (the
    checkpoint's buffers, which override config.json, are held to the same rule)."""
    for key, value in (("sampling_eps_min", low), ("sampling_eps_max", high)):
        if not unit_interval(value):
            raise ConfigError(f"{where}: {key}={value!r} is invalid: expected a number in [0, 1].")
    if low > high:
        raise ConfigError(f"{where}: sampling_eps_min={low} is above sampling_eps_max={high}: the training clock's "
                          "interval [min, max] is reversed.")


def gidd_config(raw: dict[str, Any], name: str, path: Path) -> MDMConfig:
    check_raw(raw, SCHEMA, path)
    v = {**GIDD_DEFAULTS, **{k: raw[k] for k in GIDD_DEFAULTS if k in raw}}
    _heads(path, v["hidden_size"], v["num_attention_heads"])
    cfg = ddit_config("gidd", d_vocab=v["vocab_size"], n_ctx=v["max_seq_len"], d_model=v["hidden_size"],
                      cond_dim=v["timestep_cond_dim"], n_layers=v["num_hidden_layers"],
                      n_heads=v["num_attention_heads"], time_conditioning=True, model_name=name,
                      dropout=v["attention_dropout"], p_uniform=float(v["p_uniform"]), t_eps=float(v["t_eps"]))
    cfg.mask_token_id = v["vocab_size"] - 1  # len(tokenizer) with [PAD], [MASK] appended: [MASK] is the last id
    cfg.extra["parameterization"] = "gidd"
    check_mask_key(raw, cfg, path)
    return cfg


class _Renamed:
    """A checkpoint reader seen through a name map (GIDD's unprefixed names as `backbone.` ones) with some keys
    hidden (the buffers read separately)."""

    def __init__(self, reader: Any, prefix: str, hidden: set[str]):
        self.reader, self.prefix, self.folder = reader, prefix, reader.folder
        self.names = {prefix + k: k for k in reader.keys() if k not in hidden}

    def keys(self) -> list[str]:
        return list(self.names)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self.names[key])

    def dtype(self, key: str) -> str:
        return self.reader.dtype(self.names[key])

    def stored_name(self, key: str) -> str:
        return self.names[key]

    def get(self, key: str) -> torch.Tensor:
        return self.reader.get(self.names[key])


def _gidd_rotary(reader: Any, cfg: MDMConfig) -> None:
    d, n = cfg.d_head, cfg.n_ctx
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(n).float(), inv).repeat(1, 2)
    for key, fn, v_slot in (("rotary_emb.cos_cached", torch.cos, 1.0), ("rotary_emb.sin_cached", torch.sin, 0.0)):
        if key not in reader.keys():
            raise CheckpointError(f"{reader.folder}: {key} is missing (a GIDD-DiT checkpoint holds it).")
        got = reader.get(key).float()
        if tuple(got.shape) != (1, n, 3, 1, d) or not torch.allclose(got[0, :, 0, 0], fn(emb), atol=1e-3) or \
                not bool((got[0, :, 2] == v_slot).all()):
            raise CheckpointError(f"{reader.folder}: {key} is not the rotary table [1, max_seq_len={n}, 3, 1, {d}] "
                                  "of base 10000; config.json disagrees with the weights.")


def load_hub(cls: type, folder: Path, family: str, name: str, *, dtype: Any = torch.float32, device: Any = "cpu",
             load_tokenizer: bool = True, autocast: bool = False, device_map: Any = None, max_memory: Any = None,
             n_devices: Any = None, offload_folder: Any = None, **options: Any) -> Any:
    from mdm_lens.loading.readers import CheckpointReader
    from mdm_lens.loading.resolve import load_tokenizer as read_tokenizer

    from mdm_lens.ddit.unsupported import refuse_processing

    refuse_processing(options, family)  # weight processing: refused with its reason, before any weight is read
    accepted = f"dtype, device, allow_download, load_tokenizer, autocast, {', '.join(PLACEMENT)}"
    if options:
        raise ArgumentTypeError(f"from_pretrained got {sorted(options)}: {family} checkpoints take {accepted}.",
                                argument=sorted(options)[0], value=options, allowed=accepted)
    autocast = validate.boolean(autocast, name="autocast")
    dtype, device = _dtype(dtype), validate.device(device, name="device")
    path = Path(folder) / "config.json"
    raw = json.loads(path.read_text())
    cfg = (bd3lm_config if family == "bd3lm" else gidd_config)(raw, name, path)
    cfg.dtype, cfg.device = dtype, device
    with torch.device("meta"):
        model = cls(cfg)
    reader = CheckpointReader(folder)
    if family == "bd3lm":
        eps = {k for k in ("sampling_eps_min", "sampling_eps_max") if k in reader.keys()}
        for k in eps:
            cfg.extra[k] = float(reader.get(k))
        _eps_interval(cfg.extra["sampling_eps_min"], cfg.extra["sampling_eps_max"], f"{folder} (weights' buffers)")
        reader = _Renamed(reader, "", eps)
    else:
        _gidd_rotary(reader, cfg)
        reader = _Renamed(reader, "backbone.", {"rotary_emb.cos_cached", "rotary_emb.sin_cached"})
    load_weights(model, reader, ddit_plan(cfg), dict(device_map=device_map, max_memory=max_memory, n_devices=n_devices,
                                                     offload_folder=offload_folder))
    if validate.boolean(load_tokenizer, name="load_tokenizer"):
        model.tokenizer = read_tokenizer(folder)
        mask = getattr(model.tokenizer, "mask_token_id", None)
        if family == "gidd" and mask is not None:
            cfg.mask_token_id = int(mask)
    return model.set_autocast(autocast).eval()
