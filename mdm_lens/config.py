"""`MDMConfig`: the one description of a model that every part of mdm_lens reads.

Field names follow TransformerLens' `HookedTransformerConfig` where the concept exists there
(`d_model`, `n_layers`, `n_heads`, `d_head`, `d_mlp`, `d_vocab`, `n_ctx`), so TL utilities that read
`model.cfg` work unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mdm_lens.errors import ConfigError

# "block_causal": block diffusion (LLaDA2, SDAR, Fast-dLLM v2): the samplers run a block-causal mask whose block
# length is `extra["block_length"]`; a forward given no `block_length=` attends bidirectionally, as before.
AttentionKind = Literal["bidirectional", "causal", "block_causal"]
ATTENTION_KINDS = ("bidirectional", "causal", "block_causal")
PositionPolicy = Literal["arange", "cumsum"]


# `extra` facts read as positive ints by the forward and the samplers: checked with the config, so a bad value is a
# ConfigError naming the key at load / from_config, never an InputError at the first forward as if it were passed
EXTRA_POSITIVE_INTS = {"block_length": "the block-causal mask's default block length",
                       "gen_length": "the default answer length of the probes"}


def check_extra_ints(extra: Any, where: str = "") -> None:
    """Raise ConfigError when a key of EXTRA_POSITIVE_INTS holds anything but null or an int > 0 (`where`: the file)."""
    if not isinstance(extra, dict):
        return  # its type is checked where it is read (native config.json: check_native_raw)
    for key, what in EXTRA_POSITIVE_INTS.items():
        value = extra.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{where}extra.{key}={value!r} is invalid: expected an int > 0 or null ({what}). It is "
                              "a config fact: fix the config (config.json's \"extra\" / MDMConfig(extra=...)).")


DTYPES = ("float32", "float16", "bfloat16", "float64")
#: what HookedMDM implements; TL's helpers read these fields, so another value would mislead them
TL_CONSTANTS = {"normalization_type": "RMS", "act_fn": "silu", "positional_embedding_type": "rotary",
                "attn_only": False}


def check_tl_constants(values: dict[str, Any], prefix: str = "") -> None:
    """The TransformerLens fields a HookedMDM only ever computes one way: another value is a ConfigError (the
    model would still compute RMSNorm / SiLU / rotary / MLPs while TL's helpers read the value given)."""
    for key, want in TL_CONSTANTS.items():
        if key in values and (values[key] != want or type(values[key]) is not type(want)):
            why = (" (RMSPre marks a processed model; mdm_lens saves and loads unprocessed weights: pass fold_ln=True "
                   "to from_pretrained instead)" if values[key] == "RMSPre" else "")
            raise ConfigError(f"{prefix}{key}={values[key]!r} is invalid: HookedMDM implements {key}={want!r} only"
                              f"{why}; TransformerLens' helpers read this field, so another value would mislead them.")


def _checked_dtype(dtype: Any) -> torch.dtype:
    """A floating dtype the model computes in, given as a torch.dtype or its name ("float32", "torch.float32")."""
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(dtype, (str, torch.dtype)) or name not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)} (a torch.dtype or "
                          "its name).")
    return getattr(torch, name)


@dataclass
class MDMConfig:
    d_model: int
    n_layers: int
    n_heads: int
    d_mlp: int
    d_vocab: int
    n_kv_heads: int | None = None  # None = multi-head attention (n_kv_heads == n_heads)
    d_head: int | None = None  # None = d_model // n_heads
    n_ctx: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    attention: AttentionKind = "bidirectional"
    # Dream keeps its AR initialisation's alignment: hidden state i-1 predicts token i.
    logit_shift: bool = False
    # LLaDA rotates q/k in fp32 and casts back; HF Llama/Qwen2 cast cos/sin to the activation dtype.
    # Identical in fp32, ~1e-2 apart in bf16, so we follow each family's own choice.
    rope_full_precision: bool = False
    # Positions under left padding: LLaDA uses raw 0..T-1, Dream the cumulative count of real tokens.
    position_policy: PositionPolicy = "arange"
    # Padded batches: LLaDA/HF hide pad *keys* only ("key"); Dream's sampler masks pad rows too ("pair").
    padding_mask: Literal["key", "pair"] = "key"
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    family: str = "custom"  # llada | dream | llama | qwen2 | mdm_lens | custom
    model_name: str = "custom"
    use_attn_result: bool = False  # TL's opt-in per-head `hook_result` [batch, pos, head, d_model]
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific facts (special tokens, eot id…)

    # TransformerLens compatibility constants: these models are pre-RMSNorm, rotary, never attn-only.
    normalization_type: str = "RMS"
    positional_embedding_type: str = "rotary"
    attn_only: bool = False
    act_fn: str = "silu"

    def __post_init__(self) -> None:
        self._check_values()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass d_head explicitly."
                )
            self.d_head = self.d_model // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each key/value head among n_heads/n_kv_heads queries)."
            )
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}.")
        if self.position_policy not in ("arange", "cumsum"):
            raise ConfigError(f"position_policy must be 'arange' or 'cumsum', got {self.position_policy!r}.")
        if self.padding_mask not in ("key", "pair"):
            raise ConfigError(f"padding_mask must be 'key' or 'pair', got {self.padding_mask!r}.")
        if self.d_head % 2:
            raise ConfigError(f"rotary embeddings need an even d_head, got {self.d_head}.")
        self.dtype = _checked_dtype(self.dtype)

    def _check_values(self) -> None:
        """Types and ranges of every number: a null or negative size, or an id outside the vocabulary, is a
        ConfigError naming the field now, not a shape error or a wrong token later."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("d_model", "n_layers", "n_heads", "d_mlp", "d_vocab", "n_ctx"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} is invalid: expected an int > 0.")
        for name in ("n_kv_heads", "d_head"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise ConfigError(f"{name}={value!r} is invalid: expected an int > 0 or None.")
        for name, low_open in (("rope_theta", True), ("norm_eps", False)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < 0 or (low_open and value == 0)):
                raise ConfigError(f"{name}={value!r} is invalid: expected a finite number {'>' if low_open else '>='} 0.")
        for name in ("qkv_bias", "logit_shift", "rope_full_precision", "tie_word_embeddings", "use_attn_result"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: expected True or False.")
        for name in ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value < self.d_vocab):
                raise ConfigError(f"{name}={value!r} is invalid: expected None or a token id in [0, d_vocab="
                                  f"{self.d_vocab}).")

        if not isinstance(self.extra, dict):  # every family fact is read with extra.get(...)
            raise ConfigError(f"extra={self.extra!r} is invalid: expected a dict of family facts (e.g. "
                              "{'block_length': 32}).")
        check_extra_ints(self.extra)

    # --- TransformerLens aliases -------------------------------------------------------------------
    @property
    def n_key_value_heads(self) -> int:
        return int(self.n_kv_heads)  # type: ignore[arg-type]

    @property
    def is_mdm(self) -> bool:
        return self.attention != "causal"

    @property
    def attention_label(self) -> str:
        """`attention` for people: block-causal models name their sampler block length."""
        if self.attention == "block_causal":
            return f"block-causal (block_length={self.extra.get('block_length')})"
        return self.attention

    @property
    def n_params(self) -> int:
        """Learned weights of the model (`sum(p.numel() for p in model.parameters())`): every routed expert,
        shared expert and router of a mixture-of-experts layer counted once. LLaDA2's `expert_bias` (a buffer,
        updated by load balancing, not by gradient) is not counted. `n_params_active`: those one token uses."""
        return self._count(active=False)

    @property
    def n_params_active(self) -> int:
        """Weights one token's forward uses: as `n_params`, but only `top_k` routed experts per MoE layer (the
        router and shared expert always run); equals `n_params` for a dense model."""
        return self._count(active=True)

    def _count(self, active: bool) -> int:
        d, L, h, g, e, f, v = (self.d_model, self.n_layers, self.n_heads, self.n_key_value_heads,
                               self.d_head, self.d_mlp, self.d_vocab)
        attn = d * e * (h + 2 * g) + h * e * d
        attn += e * (h + 2 * g) if self.qkv_bias else 0
        attn += d if self.extra.get("o_bias") else 0
        attn += 2 * e if self.extra.get("qk_norm") else 0  # one d_head RMSNorm weight for q, one for k
        norms = 0 if self.normalization_type == "RMSPre" else 1  # fold_ln moved the norm weights into matrices
        moe = self.extra.get("moe")
        moe_layers = self.extra.get("moe_layers") or [False] * L
        total = 0
        for is_moe in moe_layers:
            if is_moe and moe is not None:
                n_routed = int(moe["top_k"]) if active else int(moe["n_experts"])
                mlp = int(moe["n_experts"]) * d + n_routed * 3 * d * int(moe["d_expert"])
                mlp += 3 * d * int(moe["d_shared"]) if moe.get("d_shared") else 0
            else:
                mlp = 3 * d * f
            total += attn + mlp + 2 * d * norms
        return total + d * norms + v * d * (1 if self.tie_word_embeddings else 2)

    # --- (de)serialisation for our own checkpoint format ------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f_ in dataclasses.fields(self):
            value = getattr(self, f_.name)
            if f_.name == "dtype":
                value = str(value).removeprefix("torch.")
            elif f_.name == "device":
                continue
            out[f_.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MDMConfig":
        known = {f_.name for f_ in dataclasses.fields(cls)}
        unknown = set(data) - known - {"model_type"}
        if unknown:
            raise ConfigError(f"unknown MDMConfig fields {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> str:
        return json.dumps({"model_type": "mdm_lens", **self.to_dict()}, indent=2)
