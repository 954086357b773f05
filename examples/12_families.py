"""12 — The 2026 families (LLaDA2.x, LLaDA-MoE, SDAR, SDAR-MoE) on tiny RANDOM weights.

Each family's config.json is written in its hub layout (the keys the released files use) and read by the
same code `HookedMDM.from_pretrained` uses; the weights are random (`from_config`), so the numbers say how
the machinery behaves, not what a trained model does. Shows: the block-causal forward (blocks aligned at
position 0), the MoE router hooks, and LLaDA2's expert bias steering the choice but not the weights.

    python examples/12_families.py
"""

import json
import tempfile
from pathlib import Path

import torch

from mdm_lens import HookedMDM
from mdm_lens.loading import read_config

COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=3, max_position_embeddings=256)
CONFIGS = {
    "LLaDA2.x": dict(COMMON, architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", num_key_value_heads=2,
                     intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_shared_experts=1,
                     num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, mask_token_id=63),
    "LLaDA-MoE": dict(COMMON, architectures=["LLaDAMoEModelLM"], model_type="llada", dense_intermediate_size=64,
                      expert_intermediate_size=16, shared_expert_intermediate_size=None, num_experts=8,
                      num_experts_per_tok=2, moe_layer_freq=[0, 1, 1], qk_layernorm=True, rope_theta=50000,
                      partial_rotary_factor=1.0, mask_token_id=63),
    "SDAR": dict(COMMON, architectures=["SDARForCausalLM"], model_type="sdar", num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, mask_token_id=63),
    "SDAR-MoE": dict(COMMON, architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", num_key_value_heads=2,
                     head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], mask_token_id=63),
}


def build(name: str, config: dict, root: Path) -> HookedMDM:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    cfg, _ = read_config(folder, name, None)
    return HookedMDM.from_config(cfg, seed=0, init_std=0.3)


def block_demo(model: HookedMDM, tokens: torch.Tensor) -> None:
    """Edit position 5: with blocks of 4 ([0-3] [4-7] [8-11]) only positions 4.. can see it."""
    b = 4
    edited = tokens.clone()
    edited[0, 5] = (tokens[0, 5] + 1) % 63
    with torch.no_grad():
        diff = (model(edited, block_length=b) - model(tokens, block_length=b)).abs().amax(-1)[0]
        full = (model(edited, block_length=tokens.shape[1]) - model(tokens, block_length=tokens.shape[1]))
    print(f"  block_length={b}: max |Δlogit| per position after editing token 5: "
          + " ".join(f"{v:.0e}" for v in diff.tolist()))
    print(f"  one block (bidirectional): position 0 moves by {full.abs().amax(-1)[0, 0]:.1e}")


def router_demo(model: HookedMDM, tokens: torch.Tensor) -> None:
    spec = model.cfg.extra.get("moe")
    if spec is None:
        print("  dense model: no router")
        return
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "mlp.hook_expert" in n)
    for layer, moe in enumerate(model.cfg.extra["moe_layers"]):
        if not moe:
            print(f"  layer {layer}: dense MLP (d_mlp={model.cfg.d_mlp})")
            continue
        index = cache[f"blocks.{layer}.mlp.hook_expert_indices"]
        weights = cache[f"blocks.{layer}.mlp.hook_expert_weights"]
        counts = torch.bincount(index.flatten(), minlength=spec["n_experts"]).tolist()
        print(f"  layer {layer}: {spec['score']} router, top-{spec['top_k']} of {spec['n_experts']}; tokens per "
              f"expert {counts}; weight sum per token {weights.sum(-1).mean():.3f}")


def bias_demo(model: HookedMDM, tokens: torch.Tensor) -> None:
    mlp = model.blocks[1].mlp
    with torch.no_grad():
        mlp.expert_bias[7] = 5.0  # LLaDA2 adds the bias for the choice only
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.1.mlp.hook_"))
        mlp.expert_bias.zero_()
    index = cache["blocks.1.mlp.hook_expert_indices"]
    chosen = torch.sigmoid(cache["blocks.1.mlp.hook_router_logits"]).gather(-1, index)
    expected = chosen / chosen.sum(-1, keepdim=True) * model.cfg.extra["moe"]["scaling"]
    print(f"  expert_bias[7]=5: expert 7 chosen by {(index == 7).any(-1).float().mean():.0%} of tokens; weights "
          f"= renormalised unbiased sigmoid scores (max diff "
          f"{(cache['blocks.1.mlp.hook_expert_weights'] - expected).abs().max():.1e})")


def main() -> None:
    tokens = torch.randint(0, 63, (1, 12), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            model = build(name, config, Path(tmp))
            c = model.cfg
            print(f"\n== {name}: {model!r}\n  block_length default={c.extra.get('block_length')}, "
                  f"rotary dims={c.extra.get('rotary_dim') or c.d_head}/{c.d_head}, mask id={c.mask_token_id}")
            if c.extra.get("block_length"):
                block_demo(model, tokens)
            router_demo(model, tokens)
            if name == "LLaDA2.x":
                bias_demo(model, tokens)


if __name__ == "__main__":
    main()
