"""Nemotron-Labs-Diffusion: a tiny checkpoint in the hub layout (config.json keys and `encoder.*` /
`diffusion_head.weight` names, shared/specs/families-2.md §9.2-9.3) and a plain-torch reference of its forward,
transcribed from the vLLM port (`nemotron_dllm.py`: Llama attention + HF YaRN factor + llama-4 query scale after
RoPE) and transformers' `_compute_yarn_parameters`, independent of mdm_lens' modules.

`reference_forward` runs one forward over `tokens` at absolute positions `past_len..`, attending to the cached
keys/values `past` ([k, v] per layer, after RoPE) and its own rows, bidirectionally (diffusion mode) or causally
(AR mode), and returns (logits, the rows' [k, v] per layer), so the samplers' references can keep a cache.

Precision: the port computes the rotary tables, the query scale, the RMSNorm statistics and the softmax in fp32
(`.to(torch.float32)`, `positions.float()`). That is kept for fp32 / bf16 / fp16 weights; with float64 weights
every one of them is float64 (`_wide`), since there `.float()` would be a downcast and a float64 comparison would
measure fp32 rounding (2e-6 tiny, 1e-4 at d_model 256) instead of the transcription."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdm_lens.init import norm_weight_draw

VOCAB, MASK_ID, EOS_ID = 101, 100, 98
# every key differs from NemotronLabsDiffusionConfig's default (the sizes are tiny; head_dim != hidden / heads)
CONFIG = dict(
    architectures=["NemotronLabsDiffusionModel"], model_type="nemotron_labs_diffusion",
    auto_map={"AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, hidden_act="silu", max_position_embeddings=96, rms_norm_eps=1e-6,
    bos_token_id=96, eos_token_id=EOS_ID, pad_token_id=99, tie_word_embeddings=False, attention_bias=False,
    mlp_bias=False, sliding_window=None, mask_token_id=MASK_ID, dlm_paradigm="bidirectional", block_size=4,
    rope_parameters=dict(rope_type="yarn", factor=0.25, original_max_position_embeddings=16, beta_fast=4.0,
                         beta_slow=0.5, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3,
                         rope_theta=10000.0),
)


def write_nemotron(folder: Path, seed: int = 0, drop: tuple[str, ...] = (), **overrides) -> tuple[Path, dict, dict]:
    """The checkpoint (config keys in `drop` left out: the class defaults apply) and its (config, state dict)."""
    config = {k: v for k, v in {**CONFIG, **overrides}.items() if k not in drop}
    g = torch.Generator().manual_seed(seed)
    d, h, e, f = (config[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "intermediate_size"))
    kv = config.get("num_key_value_heads") or h

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    sd = {"encoder.embed_tokens.weight": rand(VOCAB, d, scale=1.0), "encoder.norm.weight": norm_weight_draw((d,), g)}
    if not config.get("tie_word_embeddings", False):
        sd["diffusion_head.weight"] = rand(VOCAB, d, scale=0.3)
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight_draw((d,), g)
        sd[p + "post_attention_layernorm.weight"] = norm_weight_draw((d,), g)
        for name, rows in (("q", h * e), ("k", kv * e), ("v", kv * e)):
            sd[f"{p}self_attn.{name}_proj.weight"] = rand(rows, d, scale=0.2)
        sd[p + "self_attn.o_proj.weight"] = rand(d, h * e, scale=0.1)
        sd[p + "mlp.gate_proj.weight"] = rand(f, d, scale=0.1)
        sd[p + "mlp.up_proj.weight"] = rand(f, d, scale=0.1)
        sd[p + "mlp.down_proj.weight"] = rand(d, f, scale=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return folder, config, sd


# ----------------------------------------------------------------------------------------------- reference
def _get(config: dict, key: str, default):
    return config.get(key, default) if config.get(key) is not None else default


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The port's fp32, except float64 for float64 weights (module docstring)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_inv_freq(config: dict, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """HF `_compute_yarn_parameters` (yarn) or the plain frequencies (in `dtype`), and the cos/sin factor."""
    rp = config.get("rope_parameters") or {}
    base = rp.get("rope_theta", config.get("rope_theta", 1e6))
    dim = _get(config, "head_dim", 128)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype) / dim)
    if rp.get("rope_type", "default") != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor, omax = rp["factor"], rp.get("original_max_position_embeddings", config["max_position_embeddings"])

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rp.get("attention_factor")
    if att is None:
        att = (get_mscale(factor, rp["mscale"]) / get_mscale(factor, rp["mscale_all_dim"])
               if rp.get("mscale") and rp.get("mscale_all_dim") else get_mscale(factor))
    bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(rot):
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr(bf), corr(bs)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - lo) / (hi - lo), 0, 1)
    extra_factor = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
    return inv, float(att)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xw = x.to(_wide(x.dtype))
    var = xw.pow(2).mean(-1, keepdim=True)
    return w * (xw * torch.rsqrt(var + eps)).to(x.dtype)


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@torch.no_grad()
def reference_forward(sd: dict, config: dict, tokens: torch.Tensor, past: list | None = None,
                      causal: bool = False) -> tuple[torch.Tensor, list]:
    b, t = tokens.shape
    past_len = 0 if not past else past[0][0].shape[2]
    h, e = config["num_attention_heads"], config["head_dim"]
    kvh = config.get("num_key_value_heads") or h
    eps = config.get("rms_norm_eps", 1e-5)
    wide = _wide(sd["encoder.embed_tokens.weight"].dtype)
    pos = torch.arange(past_len, past_len + t).to(wide)
    inv, att = reference_inv_freq(config, wide)
    freqs = pos[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos() * att, emb.sin() * att
    rp = config.get("rope_parameters") or {}
    beta = rp.get("llama_4_scaling_beta")
    omax = rp.get("original_max_position_embeddings", config["max_position_embeddings"])
    qscale = 1.0 + beta * torch.log(1.0 + torch.floor(pos / omax)) if beta is not None else torch.ones(t)
    keys = torch.arange(past_len + t)
    visible = (keys[None, :] <= (past_len + torch.arange(t))[:, None]) if causal else torch.ones(t, past_len + t,
                                                                                               dtype=torch.bool)
    x = sd["encoder.embed_tokens.weight"][tokens]
    new = []
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        hn = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (hn @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, h, e).transpose(1, 2)
        k = (hn @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, kvh, e).transpose(1, 2)
        v = (hn @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, kvh, e).transpose(1, 2)
        q = q * cos + _rot_half(q) * sin
        k = k * cos + _rot_half(k) * sin
        q = q * qscale[None, None, :, None]
        new.append([k, v])
        if past:
            k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(e)
        s = s.masked_fill(~visible, float("-inf"))
        a = torch.softmax(s.to(wide), -1).to(q.dtype) @ v
        x = x + a.transpose(1, 2).reshape(b, t, h * e) @ sd[p + "self_attn.o_proj.weight"].T
        hn = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate = hn @ sd[p + "mlp.gate_proj.weight"].T
        up = hn @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    head = sd.get("diffusion_head.weight", sd["encoder.embed_tokens.weight"])
    return _rms(x, sd["encoder.norm.weight"], eps) @ head.T, new


def extend(past: list | None, new: list) -> list:
    """The reference's DynamicCache after a `use_cache=True` forward."""
    if not past:
        return [[k, v] for k, v in new]
    return [[torch.cat([pk, k], 2), torch.cat([pv, v], 2)] for (pk, pv), (k, v) in zip(past, new)]
