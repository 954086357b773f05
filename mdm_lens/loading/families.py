"""Dispatch for the 2026 families (LLaDA2.x, LLaDA-MoE, SDAR, SDAR-MoE, Nemotron-Labs-Diffusion, RND1, CoDA).

`family_of(config)` names the family from `architectures` first (LLaDA-MoE's `model_type` is `llada`, like
LLaDA-8B's), `family_config` builds the `MDMConfig` and `family_plan` the weight plan. Nothing from the
checkpoint is executed: `auto_map` is ignored, the modeling facts are transcribed in each loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
# the shared pieces live one level down (the loaders import them); re-exported here
from mdm_lens.loading.family_parts import (MASK_NAMES, attention_plan, dense_width, in_vocab,  # noqa: F401
                                           mask_token_id, mlp_plan, moe_plan)
from mdm_lens.loading.llada2 import config_from_llada2, llada2_plan
from mdm_lens.loading.lladamoe import config_from_lladamoe, lladamoe_plan
from mdm_lens.loading.nemotron import config_from_nemotron, nemotron_plan
from mdm_lens.loading.coda import coda_plan, config_from_coda
from mdm_lens.loading.plan import Plan
from mdm_lens.loading.rnd1 import config_from_rnd1, rnd1_plan
from mdm_lens.loading.sdar import config_from_sdar, sdar_plan

ARCHITECTURES = {"LLaDA2MoeModelLM": "llada2_moe", "LLaDAMoEModelLM": "lladamoe", "SDARForCausalLM": "sdar",
                 "SDARMoeForCausalLM": "sdar_moe", "NemotronLabsDiffusionModel": "nemotron_dllm", "RND1LM": "rnd1",
                 "CoDALanguageModel": "coda"}
MODEL_TYPES = {"llada2_moe": "llada2_moe", "lladamoe": "lladamoe", "sdar": "sdar", "sdar_moe": "sdar_moe",
               "nemotron_labs_diffusion": "nemotron_dllm", "rnd1": "rnd1", "CoDA": "coda"}


def family_of(config: dict[str, Any]) -> str | None:
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return MODEL_TYPES.get(str(config.get("model_type", "")))


def family_config(config: dict[str, Any], family: str, name: str, folder: Path) -> MDMConfig:

    if family == "llada2_moe":
        return config_from_llada2(config, name, folder)
    if family == "lladamoe":
        return config_from_lladamoe(config, name, folder)
    if family == "nemotron_dllm":
        return config_from_nemotron(config, name, folder)
    if family == "rnd1":
        return config_from_rnd1(config, name, folder)
    if family == "coda":
        return config_from_coda(config, name, folder)
    return config_from_sdar(config, family, name, folder)


def family_plan(cfg: MDMConfig, keys: list[str]) -> Plan:

    plans = {"llada2_moe": llada2_plan, "lladamoe": lladamoe_plan, "nemotron_dllm": nemotron_plan, "rnd1": rnd1_plan,
             "coda": coda_plan}
    return plans.get(cfg.family, sdar_plan)(cfg, keys)
