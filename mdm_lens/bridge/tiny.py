"""Tiny random DiffusionGemma models (random weights: for tests, benchmarks and the demo only)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mdm_lens.init import norm_weight_draw

_TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=8)


def tiny_config(*, vocab_size: int = 128, hidden_size: int = 32, n_layers: int = 3, n_heads: int = 4,
                n_kv_heads: int = 2, global_kv_heads: int | None = 1, head_dim: int = 8, global_head_dim: int = 16,
                layer_types: list[str] | None = None, sliding_window: int = 4, num_experts: int = 4,
                top_k_experts: int = 2, softcap: float = 30.0, canvas_length: int = 8,
                attn_implementation: str = "sdpa", **text_kwargs: Any) -> Any:
    """A `DiffusionGemmaConfig` with both layer types (sliding, full), GQA, MoE and a tiny vision tower."""
    from transformers import DiffusionGemmaConfig

    if layer_types is None:
        layer_types = ["sliding_attention" if i % 3 == 0 else "full_attention" for i in range(n_layers)]
        layer_types[-1] = "full_attention"
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3 // 2,
                num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                head_dim=head_dim, global_head_dim=global_head_dim, sliding_window=sliding_window,
                layer_types=layer_types, num_experts=num_experts, top_k_experts=top_k_experts,
                moe_intermediate_size=hidden_size // 2, max_position_embeddings=512, **text_kwargs)
    if global_kv_heads is not None:
        text["num_global_key_value_heads"] = global_kv_heads
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=dict(_TINY_VISION), canvas_length=canvas_length)
    cfg.text_config.final_logit_softcapping = softcap
    cfg._attn_implementation = attn_implementation
    return cfg


def randomize(model: nn.Module, seed: int = 0, scale: float = 0.08) -> nn.Module:
    """Every parameter and the layer scalars random: norm/scale weights and layer scalars log-normal around 1
    (`mdm_lens.init.norm_weight_draw`, the fixture every test model shares: far enough from 1 that a skipped or
    misplaced norm, router scale or layer scalar changes the output), matrices normal(0, scale). DiffusionGemma's
    RMSNorm multiplies by `weight` itself (not 1 + weight), so the stored value is the effective one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(norm_weight_draw(p.shape, g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
        scalars: dict[str, torch.Tensor] = {}  # encoder and decoder layer i share one value, as weights do
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                index = name.split("layers.")[1].split(".")[0]
                b.copy_(scalars.setdefault(index, norm_weight_draw(b.shape, g)))
    return model


def tiny_diffusion_gemma(seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs: Any) -> nn.Module:
    """A random `DiffusionGemmaForBlockDiffusion` (transformers' class), in eval mode."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)  # transformers' own init draws from the global generator before we overwrite
    model = DiffusionGemmaForBlockDiffusion(tiny_config(**config_kwargs))
    randomize(model, seed)
    return model.to(dtype).eval()
