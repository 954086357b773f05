"""Peak live bytes of one forward and of the sampler step that reads its logits, tensor by tensor.

The model behind `MemoryPlan.activations`, measured with torch.profiler (`profile_memory=True`, the CPU allocator's
exact tensor allocations) on the hooked forward: the phases of a forward are never alive together, so the peak is the
*largest* phase, not their sum.

* attention phase (one block): the block input (held by the model's layer loop), the normalised input, rotated q,
  k and v (k and v are the KV cache's own tensors when a cache is on: counted there), then per path: SDPA: z and
  its flattened copy for the output projection, and that projection; chunked (reducers reading pattern rows):
  the 1/√d_head-scaled q the rows keep, z, and three `[batch, head, chunk, key]` fp32 buffers (scores, masked copy,
  softmax); explicit (a `hook_pattern` / `hook_attn_scores` cache): the scaled q and the full pattern buffers of
  `memory.pattern_transient_bytes`.
* MLP phase: block input, attention output, residual mid and its normalised copy, plus gate, up, silu(gate) and
  their product (dense); for MoE layers the dispatched rows, the slot outputs and their concatenation (see
  `moe_phase_bytes`).
* head phase: the logits in the model dtype and what the sampler allocates per logit (`sampler_logit_bytes`).

Measured on the 8-layer d_model 512 benchmark model (fp32): at batch 8 × 512 the largest block phase is the MLP
phase (4·d + 4·d_mlp per position), and the run's peak is the head (logits + Fast-dLLM's fp64 copy and softmax).
"""

from __future__ import annotations

from typing import Any

from mdm_lens.hooks.memory import pattern_transient_bytes

ATTENTION_PATHS = ("sdpa", "chunked", "explicit")


def attention_phase_bytes(cfg: Any, batch: int, pos: int, s: int, path: str = "sdpa", kv_cache: bool = False,
                          keys: int | None = None) -> int:
    """Live bytes while one layer's attention runs (see the module docstring for which tensors): `pos` query rows
    against `keys` keys (default `pos`; a KV-cached block forward computes a block's rows against the cache)."""
    from mdm_lens.pattern_rows import ROW_CHUNK_BYTES, chunk_rows

    keys = pos if keys is None else keys
    bt, d, qd, kd = batch * pos, cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_key_value_heads * cfg.d_head
    common = bt * (2 * d + qd + (0 if kv_cache else 2 * kd)) * s  # block input, ln1 output, q, (k, v)
    mask = batch * pos * keys  # a padded batch's boolean visibility mask (1 byte a pair; absent without pads)
    if path == "sdpa":  # CPU/GPU flash kernels work on tiles; z, its flattened copy and the projection are full size
        return common + mask + bt * (2 * qd + d) * s
    if path == "chunked":
        rows = min(pos, chunk_rows(batch, cfg.n_heads, pos, keys, ROW_CHUNK_BYTES))
        return common + mask + bt * 2 * qd * s + 3 * batch * cfg.n_heads * rows * keys * 4
    full = pattern_transient_bytes(cfg, batch, keys, None, s, True) * pos // max(keys, 1)  # [.., pos, keys] buffers
    return common + mask + bt * 2 * qd * s + full


def mlp_phase_bytes(cfg: Any, batch: int, pos: int, s: int, moe: bool = False) -> int:
    """Live bytes while one layer's feed-forward runs: the block's four `[batch, pos, d_model]` tensors (input,
    attention output, residual mid, normalised copy) plus the dense MLP's or the MoE layer's own buffers."""
    bt = batch * pos
    block = 4 * bt * cfg.d_model * s
    if moe:
        return block + moe_phase_bytes(cfg, batch, pos, s)
    if cfg.normalization_type == "LN":  # the DDiT families' ungated MLP: fc_in's output and its GELU, both still
        return block + bt * (2 * cfg.d_mlp + cfg.d_model) * s  # referenced while fc_out writes its output
    return block + 4 * bt * cfg.d_mlp * s  # gate, up, silu(gate) and the product being written


def moe_phase_bytes(cfg: Any, batch: int, pos: int, s: int) -> int:
    """`mdm_lens.moe.MoEMLP`'s buffers: the router's fp32 logits/scores, the `top_k` dispatched copies of every
    row, and by router: LLaDA2 (sigmoid) keeps the merged slot tensor, all expert outputs (a list, concatenated:
    a second copy) and then the fp32 weighted slots; the softmax routers accumulate into one `[rows, d_model]` sum
    with each expert's weighted output. One expert's MLP runs on at most every row (a token picks an expert once),
    and the shared expert runs on all rows after the routed sum."""
    spec = cfg.extra["moe"]
    bt, d, k = batch * pos, cfg.d_model, int(spec["top_k"])
    router = 3 * bt * int(spec["n_experts"]) * 4
    slots = bt * k * d
    expert = 4 * bt * int(spec["d_expert"]) * s
    if spec["score"] == "sigmoid":
        routed = 2 * slots * s + max(expert + slots * s, 2 * slots * s, slots * 4 * (1 + int(s != 4)))
    else:
        routed = slots * s + bt * d * s + max(expert, slots * s + bt * d * 4)
    shared = int(spec.get("d_shared") or 0)
    return router + max(routed, bt * d * s + 4 * bt * shared * s)


def block_activation_bytes(cfg: Any, batch: int, pos: int, dtype_bytes: int, path: str = "sdpa",
                           kv_cache: bool = False, keys: int | None = None, attention_extra: int = 0) -> int:
    """Peak live bytes of one block on the given attention path: its larger phase (attention or feed-forward; MoE
    layers where `cfg.extra["moe_layers"]` says so), for `pos` query rows against `keys` keys (default `pos`).
    `attention_extra`: what the sampler's forward allocates in the attention phase beyond this model
    (`Sampler.attention_extra_bytes`: BD3LM's cache read back as a copy). Both phases sit beside the forward's
    rotary tables where the family builds them per forward (`rotary_table_bytes`)."""
    keys = pos if keys is None else keys
    moe_layers = cfg.extra.get("moe_layers") or []
    ffn = max(mlp_phase_bytes(cfg, batch, pos, dtype_bytes, bool(m)) for m in (list(moe_layers) or [False]))
    mask = batch * pos * keys  # the boolean visibility mask (padding, block masks) is passed to every block
    attention = attention_phase_bytes(cfg, batch, pos, dtype_bytes, path, kv_cache, keys) + attention_extra
    return max(attention, ffn + mask) + rotary_table_bytes(cfg, keys, dtype_bytes)


def rotary_table_bytes(cfg: Any, keys: int, dtype_bytes: int) -> int:
    """The DDiT families (weight-only LayerNorm, `normalization_type == "LN"`) rebuild cos and sin `[keys, d_head]`
    in fp32 (fp64 for a float64 model) at every forward and hold them through it (`ddit.components.rotary_tables`);
    the RMSNorm families keep theirs in the model's rope cache, which the plan does not count per forward."""
    if cfg.normalization_type != "LN":
        return 0
    return 2 * keys * cfg.d_head * max(4, dtype_bytes)


def sampler_logit_bytes(settings: Any, dtype_bytes: int) -> int:
    """Bytes per logit the sampler step allocates next to the logits (measured on LLaDA's and Fast-dLLM's loops):
    LLaDA's low-confidence softmax in the logits' dtype; Fast-dLLM's (KV caches, threshold / factor rules) fp64
    copy and fp64 softmax; Gumbel noise at temperature > 0 holds five fp64 buffers (the fp64 logits, the uniform
    draw, their exp and log, the negated log); classifier-free guidance keeps the unconditional logits and two
    temporaries. Other samplers get the Fast-dLLM figure as a bound (not measured)."""
    fast = any(getattr(settings, a, None) is not None for a in ("kv_cache", "threshold", "factor")) \
        or bool(getattr(settings, "use_block_cache", False)) or settings is None
    known = settings is not None and hasattr(settings, "remasking")
    extra = 16 if fast or not known else (dtype_bytes if settings.remasking == "low_confidence" else 0)
    if float(getattr(settings, "temperature", 0.0) or 0.0) > 0:
        extra = max(extra, 5 * 8)
    if float(getattr(settings, "cfg_scale", 0.0) or 0.0) > 0:
        extra += 3 * dtype_bytes
    return extra


def carried_logit_bytes(settings: Any, dtype_bytes: int) -> int:
    """Bytes per logit of the previous step the sampler still references while the next forward runs (`logits =
    model(...)` rebinds only once the forward returns): the logits, and LLaDA's low-confidence softmax `p`."""
    fast = settings is None or any(getattr(settings, a, None) is not None for a in ("kv_cache", "threshold", "factor"))
    keeps_p = not fast and getattr(settings, "remasking", None) == "low_confidence"
    return dtype_bytes * (1 + int(keeps_p))


def head_activation_bytes(cfg: Any, batch: int, pos: int, dtype_bytes: int, per_logit: int = 16,
                          carried: int = 0, sampled: int | None = None, per_row_logit: int = 0) -> int:
    """The logits `[batch, pos, d_vocab]` in the model dtype plus `per_logit` sampler bytes for each of the
    `sampled` rows' logits (default all `pos`; a block sampler samples its block) and `per_row_logit` for each of
    every row's (a shifted copy of the logits), or, if larger, the unembedding's own moment (final residual, its
    normalised copy, the new logits and the `carried` bytes per logit of the previous step)."""
    bt, s = batch * pos, dtype_bytes
    sampled = pos if sampled is None else sampled
    step = bt * cfg.d_vocab * (s + per_row_logit) + batch * sampled * cfg.d_vocab * per_logit
    return max(step, bt * (2 * cfg.d_model * s + cfg.d_vocab * (s + carried)))
