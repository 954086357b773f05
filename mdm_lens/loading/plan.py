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


def source_shapes(cfg: MDMConfig, plan: Plan, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape each *source* tensor must have: a fused parameter (q|k|v, gate|up) is cut along dim 0 into
    its parts, so a wrong shape is reported on the checkpoint tensor that has it, not on the fused result."""
    q, kv, f = cfg.n_heads * cfg.d_head, cfg.n_key_value_heads * cfg.d_head, cfg.d_mlp
    out: dict[str, tuple[int, ...]] = {}
    for target, sources in plan.items():
        shape = expected[target]
        if len(sources) == 1:
            out[sources[0]] = shape
            continue
        if target.endswith(("attn.qkv_weight", "attn.qkv_bias")):
            sizes = [q, kv, kv]
        elif target.endswith("mlp.gate_up_weight"):
            sizes = [f, f]
        elif target.endswith("gate_up_weight"):  # an expert's or a shared expert's (its own d_mlp): equal halves
            sizes = [shape[0] // 2, shape[0] // 2]
        else:
            raise ValueError(f"no split known for the fused parameter {target}")  # a plan bug, not user input
        for source, size in zip(sources, sizes, strict=True):
            out[source] = (size, *shape[1:])
    return out
