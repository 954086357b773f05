"""Tiny random checkpoints written in each family's real on-disk format, plus the independent
`transformers` reference model (Llama/Qwen2, non-causal for the MDMs) holding the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mdm_lens.init import realistic_

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Matrices normal(0, 0.08); norm weights and biases then redrawn by the library's own fixture
    (`mdm_lens.init.realistic_`: log-normal norms, biases std 0.1) so a skipped or misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.08 * torch.randn(p.shape, generator=g))
    realistic_(model, seed=seed, bias_std=0.1)


def hf_reference(family: str, n_kv_heads: int = 2, seed: int = 0, **overrides) -> torch.nn.Module:
    """A transformers model with random weights; bidirectional for the diffusion families.

    `overrides` replace LlamaConfig / Qwen2Config arguments (e.g. `tie_word_embeddings=True`, `head_dim=8`,
    `rope_theta=1e4`, `rms_norm_eps=0.5`, `rope_scaling={...}`, `vocab_size=100`); `family="llada_qkv_bias"`
    is not needed: a LLaDA with q/k/v biases is the non-causal Qwen2 (see `write_llada`)."""
    causal = family in ("llama", "qwen2")
    if family in ("llada", "llama"):
        kw = dict(TINY, num_key_value_heads=n_kv_heads, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attention_bias=False, is_causal=causal)
        kw.update(overrides)
        cfg = LlamaConfig(**kw)
        cfg._attn_implementation = "eager"
        model = LlamaForCausalLM(cfg)
    else:
        kw = dict(TINY, num_key_value_heads=n_kv_heads, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, use_sliding_window=False, is_causal=causal)
        kw.update(overrides)
        cfg = Qwen2Config(**kw)
        cfg._attn_implementation = "eager"
        model = Qwen2ForCausalLM(cfg)
    _randomize(model, seed)
    return model.eval()


def write_llada(ref: LlamaForCausalLM, folder: Path, *, sharded: bool = False, config_overrides: dict | None = None,
                drop_keys: tuple[str, ...] = ()) -> Path:
    """LLaDA key names and config keys (architectures.md §2.1-2.2), from the Llama reference's weights.

    A tied reference writes no `ff_out` and `weight_tying: true`; a reference with q/k/v biases (a
    non-causal Qwen2) writes `q_proj.bias`… and `include_qkv_bias: true`. `config_overrides` then replace
    config.json keys and `drop_keys` delete them (to exercise the reference defaults)."""
    c = ref.config
    sd = ref.state_dict()
    tied = bool(c.tie_word_embeddings)
    biased = "model.layers.0.self_attn.q_proj.bias" in sd
    out = {"model.transformer.wte.weight": sd["model.embed_tokens.weight"],
           "model.transformer.ln_f.weight": sd["model.norm.weight"]}
    if not tied:
        out["model.transformer.ff_out.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        s, d = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
        for src, dst in [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "q_proj"),
                         ("self_attn.k_proj", "k_proj"), ("self_attn.v_proj", "v_proj"),
                         ("self_attn.o_proj", "attn_out"), ("post_attention_layernorm", "ff_norm"),
                         ("mlp.gate_proj", "ff_proj"), ("mlp.up_proj", "up_proj"), ("mlp.down_proj", "ff_out")]:
            out[d + dst + ".weight"] = sd[s + src + ".weight"]
        if biased:
            for proj in ("q_proj", "k_proj", "v_proj"):
                out[d + proj + ".bias"] = sd[s + "self_attn." + proj + ".bias"]
    config = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"},
        "d_model": c.hidden_size, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
        "n_layers": c.num_hidden_layers, "mlp_hidden_size": c.intermediate_size, "mlp_ratio": 4,
        "vocab_size": c.vocab_size, "embedding_size": c.vocab_size, "max_sequence_length": 256,
        "rope": True, "rope_full_precision": True, "rope_theta": _theta(c), "alibi": False,
        "layer_norm_type": "rms", "rms_norm_eps": c.rms_norm_eps, "layer_norm_with_affine": True,
        "bias_for_layer_norm": False, "attention_layer_norm": False, "include_bias": False,
        "include_qkv_bias": biased, "weight_tying": tied, "scale_logits": False, "input_emb_norm": False,
        "activation_type": "silu", "block_type": "llama", "block_group_size": 1, "multi_query_attention": None,
        "mask_token_id": 95, "eos_token_id": 1, "pad_token_id": 1, "use_cache": False,
    }
    config.update(config_overrides or {})
    for key in drop_keys:
        config.pop(key, None)
    return _write(folder, config, out, sharded)


def _theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0))


def write_dream(ref: Qwen2ForCausalLM, folder: Path, *, sharded: bool = False, config_overrides: dict | None = None,
                drop_keys: tuple[str, ...] = ()) -> Path:
    """Dream = the Qwen2 module tree with a `DreamModel` config (architectures.md §4); `config_overrides`
    and `drop_keys` edit config.json as in `write_llada`."""
    c = ref.config
    config = {"architectures": ["DreamModel"], "model_type": "Dream",
              "auto_map": {"AutoModel": "modeling_dream.DreamModel"},
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": _theta(c), "rope_scaling": None,
              "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": bool(c.tie_word_embeddings),
              "use_sliding_window": False, "mask_token_id": 95, "pad_token_id": 1}
    config.update(config_overrides or {})
    for key in drop_keys:
        config.pop(key, None)
    state = ref.state_dict()
    if c.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return _write(folder, config, state, sharded)


def write_hf(ref: torch.nn.Module, folder: Path, *, sharded: bool = False) -> Path:
    """Llama / Qwen2 exactly as transformers writes them (`save_pretrained`)."""
    ref.save_pretrained(folder, max_shard_size="40KB" if sharded else "10GB")
    return folder


def write_bin(ref: torch.nn.Module, folder: Path) -> Path:
    """The legacy PyTorch format (`pytorch_model.bin`), read back with weights_only=True."""
    folder.mkdir(parents=True, exist_ok=True)
    ref.config.to_json_file(folder / "config.json")
    torch.save({k: v.clone() for k, v in ref.state_dict().items()}, folder / "pytorch_model.bin")
    return folder


def _write(folder: Path, config: dict, tensors: dict, sharded: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    keys = sorted(tensors)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for n, part in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / fname))
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
