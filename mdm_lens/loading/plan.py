"""A weight plan maps each HookedMDM parameter to the checkpoint tensors it is made of.

Fused parameters (q/k/v, gate/up) are the concatenation of their sources along dim 0, so every
family converter is just a dictionary of names."""

from __future__ import annotations

from mdm_lens.config import MDMConfig

Plan = dict[str, list[str]]


def block_plan(cfg: MDMConfig, layer: int, names: dict[str, str], qkv_bias: bool) -> Plan:
    """`names` gives the source key of each role for this layer: ln1, q, k, v, o, ln2, gate, up, down."""
    p = f"blocks.{layer}."
    plan = {
        p + "ln1.w": [names["ln1"]],
        p + "attn.qkv_weight": [names["q"], names["k"], names["v"]],
        p + "attn.o_weight": [names["o"]],
        p + "ln2.w": [names["ln2"]],
        p + "mlp.gate_up_weight": [names["gate"], names["up"]],
        p + "mlp.down_weight": [names["down"]],
    }
    if qkv_bias:
        plan[p + "attn.qkv_bias"] = [names["q_bias"], names["k_bias"], names["v_bias"]]
    return plan


def expected_shapes(cfg: MDMConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each *source* role, used to name the exact tensor that does not fit."""
    h, g, e, d, f, v = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model, cfg.d_mlp, cfg.d_vocab
    return {"ln1": (d,), "ln2": (d,), "q": (h * e, d), "k": (g * e, d), "v": (g * e, d), "o": (d, h * e),
            "gate": (f, d), "up": (f, d), "down": (d, f), "q_bias": (h * e,), "k_bias": (g * e,),
            "v_bias": (g * e,), "embed": (v, d), "unembed": (v, d), "norm": (d,)}
