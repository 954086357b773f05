"""The hooked building blocks: RMSNorm, attention (GQA, rotate-half RoPE, masks, SDPA fast path),
gated SiLU MLP, and the pre-norm block.

Weights are stored fused in the layout the matmuls want (one GEMM for q/k/v, one for gate/up), and
the TransformerLens per-head views (`W_Q [head, d_model, d_head]`, …) are exposed as properties that
*view* those parameters, so writing into `W_Q` edits the model, as in TL.
"""

from __future__ import annotations

import math
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.config import MDMConfig
from mdm_lens.offload_checks import guard_views
from mdm_lens.readonly import read_only
from mdm_lens.pattern_rows import PatternRows, RowConsumer, chunk_rows, masked_scores, softmax_rows
from mdm_lens.precision import at_least_fp32


class RMSNorm(nn.Module):
    """`w * x / sqrt(mean(x²) + eps)`, normalised in fp32 (float64 for a float64 model, `mdm_lens.precision`) and
    cast back (HF Llama order).

    After `fold_ln` (`mdm_lens.processing`) the weight lives in the matrices that read this norm's output and
    `w` is None (TL's "RMSPre"): the forward returns `hook_normalized` itself. In both modes `hook_scale` is
    the root-mean-square and `hook_normalized` is `x / scale`, before any weight (TL's meaning)."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.w: nn.Parameter | None = nn.Parameter(torch.ones(cfg.d_model, dtype=cfg.dtype))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model], before the weight (TL convention)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        x32 = at_least_fp32(x)
        scale = self.hook_scale(self._rms(x32))
        return self.apply_weight(self.hook_normalized((x32 / scale).to(x.dtype)))

    def _rms(self, x32: Tensor) -> Tensor:
        return (x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def normalize(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """`x / scale` with `x`'s own statistics and no weight, no hooks (what `hook_normalized` holds): the cache's
        recomputed-statistics logit lens, whose directions carry the weight already."""
        x32 = at_least_fp32(x)
        return (x32 / self._rms(x32)).to(x.dtype)

    def apply_weight(self, normalized: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """`normalized * w`, or `normalized` itself once the weight is folded away."""
        return normalized if self.w is None else normalized * self.w


def rotary_cos_sin(positions: Int[Tensor, "batch pos"], d_head: int, theta: float, dtype: torch.dtype = torch.float32
                   ) -> tuple[Float[Tensor, "batch pos 1 d_head"], Float[Tensor, "batch pos 1 d_head"]]:
    """cos/sin tables for NeoX-style rotary embeddings, shaped to broadcast over heads; fp32 as the references,
    float64 when asked (a float64 model, `mdm_lens.precision`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, device=positions.device, dtype=dtype) / d_head))
    freqs = positions.to(dtype)[..., None] * inv_freq  # [batch, pos, d_head/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos(), emb.sin()


def apply_rotary(x: Float[Tensor, "batch pos head d_head"], cos: Tensor, sin: Tensor, full_precision: bool) -> Tensor:
    """`x·cos + rotate_half(x)·sin` (HF's formula), bit-identical to it but without materialising
    `rotate_half(x)`: the two halves are updated in place (a + (−b)·s == a − b·s exactly in IEEE)."""
    dtype = x.dtype
    if full_precision:
        x = at_least_fp32(x)
    else:
        cos, sin = cos.to(dtype), sin.to(dtype)
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings.

    Three numerically equivalent paths: SDPA (fast, used when nothing hooks the scores or the pattern),
    the explicit path that materialises `hook_attn_scores` and `hook_pattern`, and the query-chunked
    path that feeds pattern rows to attached row consumers (`mdm_lens.pattern_rows`: received
    attention, top-k keys…) without ever holding the whole `[batch, head, T, T]` pattern.
    """

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.cfg = cfg
        h, g, e, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
        self.n_heads, self.n_kv_heads, self.d_head = h, g, e
        self.repeat_kv_heads = h // g
        self.qkv_weight = nn.Parameter(torch.empty((h + 2 * g) * e, d, dtype=cfg.dtype))
        self.qkv_bias = nn.Parameter(torch.zeros((h + 2 * g) * e, dtype=cfg.dtype)) if cfg.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(d, h * e, dtype=cfg.dtype))
        # an output bias: LLaDA2 / LLaDA-MoE checkpoints (`o_bias`), or made by fold_value_biases
        self.register_parameter("o_bias", None)
        self.force_explicit = False  # set True to always take the explicit path (tests, benchmarks)
        self.query_chunk: int | None = None  # rows per chunk for row consumers; None = from ROW_CHUNK_BYTES
        self.row_mode = "explicit"  # z on the chunked path: "explicit" (from the chunks) or "sdpa"
        self._row_consumers: list[RowConsumer] = []
        self.kv: Any = None  # a kvcache.LayerKV while a cached decoding loop runs (keys/values of other rows)
        for name in ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_attn_scores",
                     "hook_pattern", "hook_z", "hook_result"):
            setattr(self, name, HookPoint())

    # --- TransformerLens weight views ---------------------------------------------------------------
    def _split(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h, g, e = self.n_heads, self.n_kv_heads, self.d_head
        return t.split([h * e, g * e, g * e], dim=0)

    @property
    def W_Q(self) -> Float[Tensor, "head d_model d_head"]:
        return einops.rearrange(self._split(self.qkv_weight)[0], "(h e) d -> h d e", h=self.n_heads)

    @property
    def _W_K(self) -> Float[Tensor, "kv_head d_model d_head"]:
        return einops.rearrange(self._split(self.qkv_weight)[1], "(g e) d -> g d e", g=self.n_kv_heads)

    @property
    def _W_V(self) -> Float[Tensor, "kv_head d_model d_head"]:
        return einops.rearrange(self._split(self.qkv_weight)[2], "(g e) d -> g d e", g=self.n_kv_heads)

    def _per_query_head(self, kv: Tensor, name: str) -> Tensor:
        """Key/value views per query head: the parameter's own view under MHA; under GQA each kv head is repeated
        (HF `repeat_kv` order), a copy, so it is read-only and the error points at the kv-head view."""
        if self.repeat_kv_heads == 1:
            return kv
        return read_only(kv.repeat_interleave(self.repeat_kv_heads, dim=0),
                         f"attn.{name} repeats each of the {self.n_kv_heads} key/value heads for "
                         f"{self.repeat_kv_heads} query heads (a copy); edit attn._{name} [kv_head, ...] instead.")

    @property
    def W_K(self) -> Float[Tensor, "head d_model d_head"]:
        return self._per_query_head(self._W_K, "W_K")

    @property
    def W_V(self) -> Float[Tensor, "head d_model d_head"]:
        return self._per_query_head(self._W_V, "W_V")

    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]:
        return einops.rearrange(self.o_weight, "d (h e) -> h e d", h=self.n_heads)

    def _bias(self, i: int, heads: int) -> Tensor:
        if self.qkv_bias is None:
            return read_only(torch.zeros(heads, self.d_head, dtype=self.o_weight.dtype, device=self.o_weight.device),
                             "this checkpoint has no q/k/v bias (cfg.qkv_bias=False); the zeros are not a parameter.")
        return self._split(self.qkv_bias)[i].view(heads, self.d_head)

    @property
    def b_Q(self) -> Float[Tensor, "head d_head"]:
        return self._bias(0, self.n_heads)

    @property
    def _b_K(self) -> Tensor:
        return self._bias(1, self.n_kv_heads)

    @property
    def _b_V(self) -> Tensor:
        return self._bias(2, self.n_kv_heads)

    @property
    def b_K(self) -> Float[Tensor, "head d_head"]:
        return self._per_query_head(self._b_K, "b_K")

    @property
    def b_V(self) -> Float[Tensor, "head d_head"]:
        return self._per_query_head(self._b_V, "b_V")

    @property
    def b_O(self) -> Float[Tensor, "d_model"]:
        if self.o_bias is not None:
            return self.o_bias
        return read_only(torch.zeros(self.cfg.d_model, dtype=self.o_weight.dtype, device=self.o_weight.device),
                         "this attention has no output bias (fold_value_biases or an o_bias checkpoint makes one).")

    # --- forward ------------------------------------------------------------------------------------
    def needs_explicit(self) -> bool:
        return self.force_explicit or self.hook_attn_scores.has_hooks() or self.hook_pattern.has_hooks()

    def _qk_hooked(self) -> bool:
        """A forward hook on q/k (before or after rotary) may write NaN/inf there (list truthiness: no scan)."""
        return bool(self.hook_q.fwd_hooks or self.hook_k.fwd_hooks or self.hook_rot_q.fwd_hooks
                    or self.hook_rot_k.fwd_hooks)

    def _needs_explicit_for(self, q: Tensor, k: Tensor) -> bool:
        """The explicit path, also for hooked q/k that hold NaN/inf: CPU SDPA returns zeros for such rows, so a
        broken hook would yield finite logits and pass the samplers' NonFiniteError guard. Only hooked layers pay
        the finiteness check; finite hooked q/k keep SDPA (no T² pattern for a cache of hook_q)."""
        if self.needs_explicit():
            return True
        return self._qk_hooked() and not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all()))

    def add_row_consumer(self, consumer: RowConsumer) -> None:
        """Feed `consumer` this forward's pattern rows (called by `pattern_rows.row_hook` from hook_rot_k)."""
        self._row_consumers.append(consumer)

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        cos: Tensor,
        sin: Tensor,
        mask: Bool[Tensor, "batch 1 query key"] | None,
        is_causal: bool,
    ) -> Float[Tensor, "batch pos d_model"]:
        b, p, _ = x.shape
        h, g, e = self.n_heads, self.n_kv_heads, self.d_head
        self._row_consumers = []  # consumers attach themselves from hook_rot_k, for this forward only
        # Three GEMMs on row slices of the fused weight (views, no copy) rather than one fused GEMM: at
        # T = 256 the fused [d, 3d] GEMM was ~10% slower on CPU, and its strided V slowed SDPA by ~8%.
        weights = self._split(self.qkv_weight)
        biases = self._split(self.qkv_bias) if self.qkv_bias is not None else (None, None, None)
        q, k, v = (F.linear(x, w, bias) for w, bias in zip(weights, biases))
        q = self.hook_q(q.view(b, p, h, e))
        k = self.hook_k(k.view(b, p, g, e))
        v = self.hook_v(v.view(b, p, g, e))
        q, k, v = self.rotate(q, k, v, cos, sin)
        if self.kv is not None:  # the window's new rows join (or overwrite) the cached ones
            k, v = self.kv(k, v)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [batch, head, pos, d_head]
        consumers, self._row_consumers = self._row_consumers, []
        if self._needs_explicit_for(qh, kh):
            z = self._explicit(qh, kh, vh, mask, is_causal, consumers)
        elif consumers:
            z = self._chunked(qh, kh, vh, mask, is_causal, consumers)
        else:
            z = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal and mask is None,
                                               enable_gqa=g != h)
        z = self.hook_z(z.transpose(1, 2))  # [batch, pos, head, d_head]
        if self.cfg.use_attn_result:  # TL: per-head results only when asked (memory: batch·pos·head·d_model)
            result = self.hook_result(torch.einsum("bphe,hed->bphd", z, self.W_O))
            out = result.sum(dim=2)
        else:
            out = F.linear(z.reshape(b, p, h * e), self.o_weight)
        return out if self.o_bias is None else out + self.o_bias

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q/k/v `[batch, pos, head, d_head]` after their hooks → rotated q and k (`hook_rot_q/k`) and v; families
        with q/k norms, clipping or partial rotary override this (`mdm_lens.qk_attention`)."""
        full = self.cfg.rope_full_precision
        return (self.hook_rot_q(apply_rotary(q, cos, sin, full)), self.hook_rot_k(apply_rotary(k, cos, sin, full)), v)

    def _explicit(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                  consumers: list[RowConsumer] = ()) -> Tensor:
        b, h, p, e = q.shape
        g, r = self.n_kv_heads, self.repeat_kv_heads
        # Scale q (T·d_head values) rather than the scores (T²); see masked_scores for the GQA fold.
        q_scaled = q * (1.0 / math.sqrt(e))
        causal = torch.arange(p, device=q.device) if is_causal and mask is None else None
        scores = self.hook_attn_scores(masked_scores(q_scaled, k, mask, causal))  # [batch, head, query, key]
        pattern = self.hook_pattern(softmax_rows(scores, mask is not None, q.dtype))
        if consumers:  # TL semantics: the consumers see the (possibly hooked) full pattern as one chunk
            _feed(consumers, PatternRows(q_scaled, k, mask, is_causal, q.dtype, pattern=pattern))
        z = torch.matmul(pattern.reshape(b, g, r * p, -1), v)  # [batch, kv_head, r·query, d_head]
        return z.view(b, h, p, e)

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                 consumers: list[RowConsumer]) -> Tensor:
        """Pattern rows a query chunk at a time for the consumers; z from the same chunks (or SDPA)."""
        b, h, p, e = q.shape
        g, r = self.n_kv_heads, self.repeat_kv_heads
        rows = PatternRows(q * (1.0 / math.sqrt(e)), k, mask, is_causal, q.dtype)
        size = self.query_chunk or chunk_rows(b, h, p, k.shape[-2])
        explicit_z = self.row_mode == "explicit"
        z = q.new_empty(b, h, p, e) if explicit_z else None
        for c in consumers:
            c.start(rows)
        for start, chunk in rows.chunks(size):
            for c in consumers:
                c.consume(chunk, start)
            if explicit_z:
                n = chunk.shape[2]
                z[:, :, start:start + n] = torch.matmul(chunk.reshape(b, g, r * n, -1), v).view(b, h, n, e)
        for c in consumers:
            c.finish()
        if explicit_z:
            return z
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                              enable_gqa=g != h)


def _feed(consumers: list[RowConsumer], rows: PatternRows) -> None:
    for c in consumers:
        c.start(rows)
        c.consume(rows.pattern, 0)
        c.finish()


class GatedMLP(nn.Module):
    """`W_out(silu(W_gate x) * W_in x)`; TL hook names: hook_pre (gate), hook_pre_linear (up), hook_post."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.d_mlp = cfg.d_mlp
        self.gate_up_weight = nn.Parameter(torch.empty(2 * cfg.d_mlp, cfg.d_model, dtype=cfg.dtype))
        self.down_weight = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp, dtype=cfg.dtype))
        self.hook_pre = HookPoint()
        self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()

    @property
    def W_gate(self) -> Float[Tensor, "d_model d_mlp"]:
        return self.gate_up_weight[: self.d_mlp].T

    @property
    def W_in(self) -> Float[Tensor, "d_model d_mlp"]:
        return self.gate_up_weight[self.d_mlp:].T

    @property
    def W_out(self) -> Float[Tensor, "d_mlp d_model"]:
        return self.down_weight.T

    @property
    def b_in(self) -> Tensor:
        return read_only(torch.zeros(self.d_mlp, dtype=self.down_weight.dtype, device=self.down_weight.device),
                         "the gated MLPs of these families have no bias; the zeros are not a parameter.")

    @property
    def b_out(self) -> Tensor:
        return read_only(torch.zeros(self.down_weight.shape[0], dtype=self.down_weight.dtype,
                                     device=self.down_weight.device),
                         "the gated MLPs of these families have no bias; the zeros are not a parameter.")

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        # Two GEMMs on row slices of the fused weight (contiguous views) rather than one fused GEMM + chunk: the
        # split form was 4-7% faster on CPU at 32-320 rows (the chunked halves are strided for silu and the product).
        gate = F.linear(x, self.gate_up_weight[: self.d_mlp])
        up = F.linear(x, self.gate_up_weight[self.d_mlp:])
        post = self.hook_post(F.silu(self.hook_pre(gate)) * self.hook_pre_linear(up))
        return F.linear(post, self.down_weight)


class Block(nn.Module):
    """Pre-norm transformer block with TransformerLens' residual hook points."""

    def __init__(self, cfg: MDMConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.ln1 = RMSNorm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = RMSNorm(cfg)
        self.mlp = GatedMLP(cfg)
        for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            setattr(self, name, HookPoint())

    def forward(self, resid: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid), cos, sin, mask, is_causal))
        resid = self.hook_resid_mid(resid + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid)))
        return self.hook_resid_post(resid + mlp_out)


# Weight views of an offloaded module (device_map with 'disk' / 'cpu' offload) raise a typed error naming it.
guard_views(Attention, ["W_Q", "_W_K", "_W_V", "W_K", "W_V", "W_O", "b_Q", "_b_K", "_b_V", "b_K", "b_V", "b_O"])
guard_views(GatedMLP, ["W_gate", "W_in", "W_out", "b_in", "b_out"])
