"""Tiny random BD3LM and GIDD-DiT checkpoints in their hub layouts (`kuleshov-group/bd3lm-owt-block_size*`,
`dvruette/gidd-*`): config.json keys as `BD3LMConfig` / `DITConfig` name them, with values that differ from the
class defaults; BD3LM weights under `backbone.` plus its top-level `sampling_eps_min/max` buffers; GIDD weights
without a prefix plus its persistent rotary tables. Norm weights log-normal around 1, biases non-zero, adaLN large."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.families.ddit_checkpoints import hub_state_dict

BD3LM_CONFIG = dict(architectures=["BD3LM"], model_type="bd3lm", return_dict=False,
                    auto_map={"AutoConfig": "configuration_bd3lm.BD3LMConfig",
                              "AutoModelForMaskedLM": "modeling_bd3lm.BD3LM"},
                    block_size=4, vocab_size=57, model_length=16, cross_attn=True, adaln=True, attn_backend="sdpa",
                    causal=False, hidden_dim=32, cond_dim=24, n_blocks=2, n_heads=4, dropout=0.1,
                    time_conditioning=False, var_min=True, sampling_eps_min=0.05, sampling_eps_max=0.8)
GIDD_CONFIG = dict(architectures=["DIT"], model_type="dit",
                   auto_map={"AutoConfig": "configuration_dit.DITConfig", "AutoModelForMaskedLM": "modeling_dit.DIT"},
                   vocab_size=59, max_seq_len=12, hidden_size=32, timestep_cond_dim=20, num_hidden_layers=2,
                   num_attention_heads=2, attention_dropout=0.0, p_uniform=0.1, t_eps=1e-4)


def _ddit_keys(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The shared DDiT tensors (`backbone.` names) for either layout."""
    return hub_state_dict(dict(hidden_dim=config.get("hidden_dim", config.get("hidden_size")),
                               cond_dim=config.get("cond_dim", config.get("timestep_cond_dim")),
                               vocab_size=config["vocab_size"], n_blocks=config.get("n_blocks",
                                                                                    config.get("num_hidden_layers")),
                               n_heads=config.get("n_heads", config.get("num_attention_heads"))), seed)


def gidd_rotary(n: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([torch.outer(torch.arange(n).float(), inv)] * 2, dim=-1)
    cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    cos[:, :, 2], sin[:, :, 2] = 1.0, 0.0
    return cos, sin


def write_bd3lm(folder: Path, config: dict = BD3LM_CONFIG, seed: int = 0, drop: tuple[str, ...] = ()
                ) -> tuple[Path, dict[str, torch.Tensor]]:
    folder.mkdir(parents=True, exist_ok=True)
    sd = _ddit_keys(config, seed)
    sd["sampling_eps_min"] = torch.tensor(float(config.get("sampling_eps_min", 1e-3)))
    sd["sampling_eps_max"] = torch.tensor(float(config.get("sampling_eps_max", 0.999)))
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in drop}))
    save_file({k: t.contiguous() for k, t in sd.items()}, str(folder / "model.safetensors"))
    return folder, sd


def write_gidd(folder: Path, config: dict = GIDD_CONFIG, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """GIDD weights (no prefix); the returned state dict keeps the `backbone.` names for the reference."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = _ddit_keys(config, seed)
    sd.pop("backbone.rotary_emb.inv_freq")
    hub = {k.removeprefix("backbone."): t for k, t in sd.items()}
    cos, sin = gidd_rotary(config["max_seq_len"], config["hidden_size"] // config["num_attention_heads"])
    hub.update({"rotary_emb.cos_cached": cos, "rotary_emb.sin_cached": sin})
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in hub.items()}, str(folder / "model.safetensors"))
    return folder, sd
