"""Pieces the 2026 family loaders share (LLaDA2.x, LLaDA-MoE, SDAR): ids from the checkpoint, layer widths, and
the weight-plan fragments of attention, dense and MoE MLPs. Below `families` (the dispatch) and the loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.plan import Plan
from mdm_lens.loading.special import TokenTable, _read_json, _token_name

MASK_NAMES = ("<|MASK|>", "<|mask|>")  # the mask token's names when config.json gives no id


def mask_token_id(config: dict[str, Any], folder: Path, d_vocab: int) -> int | None:
    """The mask id: config.json `mask_token_id`, else the tokenizer files' `mask_token`, else a token named
    `<|MASK|>` / `<|mask|>` in them; None when the folder says nothing (no guessed constant)."""
    value = config.get("mask_token_id")
    if not (isinstance(value, int) and not isinstance(value, bool)):
        table = TokenTable(folder)
        named = _token_name(_read_json(folder / "tokenizer_config.json").get("mask_token")) or _token_name(
            _read_json(folder / "special_tokens_map.json").get("mask_token"))
        value = table.get(named)
        for candidate in MASK_NAMES if value is None else ():
            value = table.get(candidate) if value is None else value
    if value is not None and not 0 <= value < d_vocab:
        raise ConfigError(f"mask token id {value} from {folder} is outside the vocabulary [0, {d_vocab}).")
    return value


def in_vocab(value: Any, d_vocab: int) -> int | None:
    """A pad/bos id from config.json or a reference default; dropped (None) when it is not an id of this
    vocabulary (the defaults belong to the released vocabularies, e.g. LLaDA2's pad 126081). A list is not a
    pad/bos id (config.json values are checked first, mdm_lens.loading.values): refused, never guessed."""
    if isinstance(value, list):
        raise ConfigError(f"a pad/bos token id must be one int, not the list {value!r} (only eos_token_id may be a "
                          "list).")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < d_vocab:
        return None
    return value


def dense_width(config: dict[str, Any], key: str, value: Any, moe_layers: list[bool], extra: dict[str, Any]) -> int:
    """`d_mlp` of the dense layers; when every layer is MoE it is the routed experts' width (unused by any
    module, kept so `cfg.d_mlp` stays a meaningful positive number)."""
    if all(moe_layers):
        return int(extra["moe"]["d_expert"])
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        origin = "" if key in config else " (absent from config.json: the reference default)"
        raise ConfigError(f"config.json has {key}={value!r}{origin}, but some layers are dense and need it.")
    return value


def mlp_plan(dst: str, src: str) -> Plan:
    """A SiLU-gated MLP stored as `gate_proj` / `up_proj` / `down_proj`."""
    return {dst + "gate_up_weight": [src + "gate_proj.weight", src + "up_proj.weight"],
            dst + "down_weight": [src + "down_proj.weight"]}


def moe_plan(cfg: MDMConfig, dst: str, src: str, router: str, bias: str | None, shared: str | None) -> Plan:
    """Router, optional `expert_bias`, `experts.{e}.*_proj` and the optional shared expert of one MoE layer."""
    spec = cfg.extra["moe"]
    plan: Plan = {dst + "router_weight": [router]}
    if spec.get("expert_bias"):
        plan[dst + "expert_bias"] = [bias]
    for e in range(spec["n_experts"]):
        plan.update(mlp_plan(f"{dst}experts.{e}.", f"{src}experts.{e}."))
    if spec.get("d_shared"):
        plan.update(mlp_plan(dst + "shared_expert.", shared))
    return plan


def attention_plan(cfg: MDMConfig, dst: str, src: str, q_norm: str = "q_norm", k_norm: str = "k_norm") -> Plan:
    """Separate `q_proj/k_proj/v_proj/o_proj` (LLaDA-MoE, SDAR), biases per `cfg.qkv_bias` / `o_bias`."""
    plan: Plan = {dst + "qkv_weight": [src + f"{n}_proj.weight" for n in "qkv"], dst + "o_weight": [src + "o_proj.weight"]}
    if cfg.qkv_bias:
        plan[dst + "qkv_bias"] = [src + f"{n}_proj.bias" for n in "qkv"]
    if cfg.extra.get("o_bias"):
        plan[dst + "o_bias"] = [src + "o_proj.bias"]
    if cfg.extra.get("qk_norm"):
        plan[dst + "q_norm.w"] = [src + q_norm + ".weight"]
        plan[dst + "k_norm.w"] = [src + k_norm + ".weight"]
    return plan


def hf_layout_plan(cfg: MDMConfig, bias: str | None, shared: str | None) -> Plan:
    """The weight plan of the transformers-style layout LLaDA-MoE and SDAR(-MoE) share (`model.embed_tokens`,
    `model.layers.{i}.self_attn / mlp`, `model.norm`, `lm_head`): dense or MoE per `cfg.extra["moe_layers"]`, the MoE
    layers' expert bias and shared expert at `src + bias` / `src + shared` when the family has them."""
    plan: Plan = {"embed.W_E": ["model.embed_tokens.weight"], "ln_final.w": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        plan["unembed.weight"] = ["lm_head.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        plan.update({dst + "ln1.w": [src + "input_layernorm.weight"],
                     dst + "ln2.w": [src + "post_attention_layernorm.weight"]})
        plan.update(attention_plan(cfg, dst + "attn.", src + "self_attn."))
        if cfg.extra["moe_layers"][i]:
            plan.update(moe_plan(cfg, dst + "mlp.", src + "mlp.", router=src + "mlp.gate.weight",
                                 bias=None if bias is None else src + bias,
                                 shared=None if shared is None else src + shared))
        else:
            plan.update(mlp_plan(dst + "mlp.", src + "mlp."))
    return plan
