"""Random checkpoints of LLaDA2.x, LLaDA-MoE, SDAR and SDAR-MoE in their hub layouts (key names and config.json
keys as the released files have them) at a benchmark size, for `bench_families`. The tests have their own tiny
writers (tests/families); benchmarks do not import tests, so the layouts are written here again from the hub
files' key names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MASK_NAME = {"llada2": "<|mask|>", "lladamoe": "<|mask|>", "sdar": "<|MASK|>", "sdar_moe": "<|MASK|>"}


def _shape(d: int, layers: int, heads: int, kv: int, vocab: int) -> dict:
    return dict(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)


def configs(d: int, layers: int, heads: int, kv: int, vocab: int, experts: int, topk: int, f_dense: int,
            f_expert: int) -> dict[str, dict]:
    """config.json of each family; MoE from layer 1 on (layer 0 dense, as LLaDA2's `first_k_dense_replace`)."""
    base = _shape(d, layers, heads, kv, vocab)
    hd = d // heads
    special = dict(pad_token_id=vocab - 3, eos_token_id=vocab - 2)
    llada2 = dict(base, **special, architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", head_dim=hd,
                  intermediate_size=f_dense, use_qkv_bias=False, use_qk_norm=True, use_bias=False,
                  rms_norm_eps=1e-6, rope_theta=600000.0, partial_rotary_factor=0.5, num_experts=experts,
                  num_shared_experts=1, num_experts_per_tok=topk, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, moe_intermediate_size=f_expert, first_k_dense_replace=1)
    lladamoe = dict(base, **special, architectures=["LLaDAMoEModelLM"], model_type="llada",
                    dense_intermediate_size=f_dense, expert_intermediate_size=f_expert,
                    shared_expert_intermediate_size=f_expert, hidden_act="silu", rms_norm_eps=1e-5,
                    rope_theta=50000, partial_rotary_factor=1.0, attention_bias=False, clip_qkv=None,
                    num_experts_per_tok=topk, num_experts=experts, norm_topk_prob=False, qk_layernorm=True,
                    moe_layer_freq=[0] + [1] * (layers - 1), moe_router_enable_expert_bias=True,
                    moe_router_score_function="softmax", routed_scaling_factor=1, router_num_group=1,
                    router_topk_group=1)
    sdar = dict(base, architectures=["SDARForCausalLM"], model_type="sdar", head_dim=hd, intermediate_size=f_dense,
                hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                use_sliding_window=False, bos_token_id=vocab - 4, eos_token_id=vocab - 2)
    sdar_moe = dict(sdar, architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", num_experts=experts,
                    num_experts_per_tok=topk, moe_intermediate_size=f_expert, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[0])
    return {"llada2": llada2, "lladamoe": lladamoe, "sdar": sdar, "sdar_moe": sdar_moe}


def _mlp(sd: dict, g: torch.Generator, prefix: str, d: int, f: int) -> None:
    sd[prefix + "gate_proj.weight"] = torch.randn(f, d, generator=g) / d ** 0.5
    sd[prefix + "up_proj.weight"] = torch.randn(f, d, generator=g) / d ** 0.5
    sd[prefix + "down_proj.weight"] = torch.randn(d, f, generator=g) / f ** 0.5


def state_dict(family: str, c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights N(0, 1/fan_in), norm weights 1 ± 0.1, router weights larger (spread routing)."""
    g = torch.Generator().manual_seed(seed)
    d, h, kv, v, n_layers = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                            "vocab_size", "num_hidden_layers"))
    hd = c.get("head_dim") or d // h
    norm = lambda n: 1.0 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    lin = lambda o, i: torch.randn(o, i, generator=g) / i ** 0.5  # noqa: E731
    emb = "model.word_embeddings.weight" if family == "llada2" else "model.embed_tokens.weight"
    sd = {emb: torch.randn(v, d, generator=g), "model.norm.weight": norm(d), "lm_head.weight": lin(v, d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(d)
        sd[p + "post_attention_layernorm.weight"] = norm(d)
        if family == "llada2":
            sd[p + "attention.query_key_value.weight"] = lin((h + 2 * kv) * hd, d)
            sd[p + "attention.dense.weight"] = lin(d, h * hd)
            sd[p + "attention.query_layernorm.weight"] = norm(hd)
            sd[p + "attention.key_layernorm.weight"] = norm(hd)
        else:
            for name, rows in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
                sd[f"{p}self_attn.{name}_proj.weight"] = lin(rows, d)
            sd[p + "self_attn.o_proj.weight"] = lin(d, h * hd)
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        dense = i == 0 or family == "sdar"
        if dense:
            f = c.get("intermediate_size") or c["dense_intermediate_size"]
            _mlp(sd, g, p + "mlp.", d, f)
            continue
        n = c["num_experts"]
        f = c.get("moe_intermediate_size") or c["expert_intermediate_size"]
        sd[p + "mlp.gate.weight"] = torch.randn(n, d, generator=g) * 0.3
        if family == "llada2":
            sd[p + "mlp.gate.expert_bias"] = 0.1 * torch.randn(n, generator=g)
        elif family == "lladamoe":
            sd[p + "mlp.expert_bias"] = 0.01 * torch.randn(n, generator=g)
        for x in range(n):
            _mlp(sd, g, f"{p}mlp.experts.{x}.", d, f)
        if family == "llada2":
            _mlp(sd, g, p + "mlp.shared_experts.", d, f * c["num_shared_experts"])
        elif family == "lladamoe":
            _mlp(sd, g, p + "shared_expert.", d, c["shared_expert_intermediate_size"])
    return sd


def write(folder: Path, family: str, c: dict, sd: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c))
    save_file({k: t.contiguous() for k, t in sd.items()}, str(folder / "model.safetensors"))
    mask_id = c["vocab_size"] - 1
    tok = {"added_tokens_decoder": {str(mask_id): {"content": MASK_NAME[family], "special": True}}}
    if family in ("llada2", "lladamoe"):
        tok["mask_token"] = MASK_NAME[family]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    return folder


def block_mask(n: int, block_length: int) -> torch.Tensor:
    """Additive `[1, 1, n, n]` block-causal mask, blocks aligned at position 0 (0 visible, -inf hidden)."""
    blk = torch.arange(n) // block_length
    visible = blk[None, :] <= blk[:, None]
    return torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
