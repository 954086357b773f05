"""BD3LM (block diffusion, `kuleshov-group/bd3lm-owt-block_size{4,8,16}`) on the DDiT core: `HookedBD3LM`.

Three forward forms of the hub `DITBackbone` (families-2.md §3.4), all through the same hooked blocks:
- sampling (default): a window of L ≤ `model_length` tokens under the block-causal mask (a query in block b sees
  blocks ≤ b), positions 0..L−1, blocks aligned to the window start;
- training / likelihood (`x0=`): the input is x_t ⊕ x_0 (2·model_length rows) under the block-diffusion mask
  (x_t block b sees itself and clean blocks < b, the clean half is block-causal), each half rotated with positions
  0..n−1; logits are returned for the x_t rows only;
- cached (`kv_cache=`): one block of `block_size` tokens whose un-rotated qkv is written into a `BD3KVCache` after
  the stored blocks; it attends to every cached key and itself, positions 0..idx+bs−1 (rotary recomputed on the
  cached qkv, as the reference does); `store_kv=True` keeps the block in the cache (sliding window at n).

The reference allocates its cache in bf16 on CUDA even in its fp32 model; ours is kept in the model dtype."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.precision import compute_dtype
from mdm_lens.ddit.components import DDiTAttention, DDiTBlock, rotary_tables, rotate_half, softmax_keys
from mdm_lens.ddit.model import FORWARD_KEYWORDS, HookedDDiT
from mdm_lens.ddit.outputs import RETURN_TYPES, check_sigma, check_tokens, finish, refuse_keywords
from mdm_lens.errors import InputError
from mdm_lens.loading.placement import execution_device


def block_diff_mask(n: int, block_size: int, device: Any = "cpu") -> Bool[Tensor, "2n 2n"]:
    """The training mask over x_t ⊕ x_0 (True = may attend)."""
    i = torch.arange(2 * n, device=device)
    clean = i >= n
    blk = torch.where(clean, i - n, i) // block_size
    q_clean, k_clean, q_blk, k_blk = clean[:, None], clean[None], blk[:, None], blk[None]
    diagonal = (q_blk == k_blk) & (q_clean == k_clean)
    offset_causal = (q_blk > k_blk) & k_clean & ~q_clean
    causal = (q_blk >= k_blk) & k_clean & q_clean
    return diagonal | offset_causal | causal


def block_causal_mask(length: int, block_size: int, device: Any = "cpu") -> Bool[Tensor, "pos pos"]:
    """The sampling mask without a cache (the clean quadrant of `block_diff_mask`): query block ≥ key block."""
    blk = torch.arange(length, device=device) // block_size
    return blk[:, None] >= blk[None]


class BD3KVCache:
    """Per-layer un-rotated qkv `[batch, n, 3·d_model]` of the stored blocks, and how many positions are stored.

    A cached forward writes its block's qkv at `[idx, idx+bs)` of every layer and attends to `[0, idx+bs)`;
    `store` (after a forward with `store_kv=True`) advances `idx` by one block; at `n` the window slides left by
    one block (the reference's sliding window; the oldest block is forgotten)."""

    def __init__(self, model: "HookedBD3LM", batch: int):
        cfg = model.cfg
        self.n, self.block_size, self.batch, self.idx = cfg.n_ctx, cfg.extra["block_size"], int(batch), 0
        # each layer's entries where its block computes (a device map may spread the blocks over devices)
        self.layers = [torch.zeros(self.batch, self.n, 3 * cfg.d_model, dtype=cfg.dtype,
                                   device=execution_device(block, lambda: model.input_device))
                       for block in model.blocks]

    @property
    def length(self) -> int:
        """Positions a cached forward attends to (the stored ones and its own block)."""
        return self.idx + self.block_size

    def write(self, layer: int, qkv: Tensor) -> Tensor:
        self.layers[layer][:, self.idx:self.idx + self.block_size] = qkv
        return self.layers[layer][:, :self.length].clone()

    def store(self) -> None:
        self.idx += self.block_size
        if self.idx >= self.n:  # keep the last n − bs positions, the next block goes at the end
            self.idx = self.n - self.block_size
            for t in self.layers:
                t[:, :-self.block_size] = t[:, self.block_size:].clone()

    def __repr__(self) -> str:
        return f"BD3KVCache(batch={self.batch}, stored={self.idx}/{self.n}, block_size={self.block_size})"


class BD3Attention(DDiTAttention):
    """DDiT attention with BD3LM's mask and KV cache. The model sets `context` (mask, cache) for the duration of
    one forward, so `DDiTBlock` is shared unchanged. Rows are the forward's query rows; key columns are the mask's
    (or the cache's `[0, idx+bs)`); `hook_q`/`hook_k`/`hook_v` see the rows' q and every key's k, v."""

    def __init__(self, cfg: MDMConfig, layer: int):
        super().__init__(cfg)
        self.layer = layer
        self.context: dict[str, Any] = {}

    def forward(self, x: Float[Tensor, "batch pos d_model"], cos: Tensor, sin: Tensor
                ) -> Float[Tensor, "batch pos d_model"]:
        b, p, _ = x.shape
        h, d = self.cfg.n_heads, self.cfg.d_head
        mask, cache = self.context.get("mask"), self.context.get("cache")
        if mask is not None:  # the context is not a forward argument: accelerate's hooks do not move it
            mask = mask.to(x.device)
        qkv = self.qkv(x)
        if cache is not None:
            qkv = cache.write(self.layer, qkv)
        keys = qkv.shape[1]
        q, k, v = qkv.view(b, keys, 3, h, d).unbind(dim=2)
        q = self.hook_q(q[:, keys - p:])  # a cached forward's rows are the last bs positions
        k, v = self.hook_k(k), self.hook_v(v)
        cos, sin = cos.to(q.dtype)[None, :, None], sin.to(q.dtype)[None, :, None]
        q = self.hook_rot_q(q * cos[:, keys - p:] + rotate_half(q) * sin[:, keys - p:])
        k = self.hook_rot_k(k * cos + rotate_half(k) * sin)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        if self._needs_pattern():
            scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
            if mask is not None:  # TL convention: hook_attn_scores sees the masked scores (−inf)
                scores = scores.masked_fill(~mask, float("-inf"))
            pattern = self.hook_pattern(softmax_keys(self.hook_attn_scores(scores)))
            z = pattern @ vh
        else:
            z = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        z = self.hook_z(z.transpose(1, 2))
        return self.hook_out(self.out(z.reshape(b, p, h * d)))


class HookedBD3LM(HookedDDiT):
    """BD3LM with TL hook points (the `HookedDDiT` surface; attention hooks as in `BD3Attention`).

    `cfg.extra`: block_size, cross_attn, attn_backend, var_min, sampling_eps_min / sampling_eps_max."""

    families = ("bd3lm",)

    @classmethod
    def load_family(cls, folder: Any, family: str, name: str, **kwargs: Any) -> "HookedBD3LM":
        """A BD3LM hub folder into this class (`mdm_lens.ddit.hub.load_hub`)."""
        from mdm_lens.ddit.hub import load_hub

        return load_hub(cls, folder, family, name, **kwargs)

    def __init__(self, cfg: MDMConfig, tokenizer: Any = None):
        super().__init__(cfg, tokenizer)
        for layer, block in enumerate(self.blocks):
            block.attn = BD3Attention(cfg, layer)
        self.setup()  # re-register the hook points of the replaced attention modules

    def new_kv_cache(self, batch: int) -> BD3KVCache:
        """An empty cache for `batch` rows (the reference's `reset_kv_cache`)."""
        return BD3KVCache(self, validate.integer(batch, name="batch", min=1))

    @contextmanager
    def _attention_context(self, **context: Any) -> Iterator[None]:
        blocks: list[DDiTBlock] = list(self.blocks)
        try:
            for block in blocks:
                block.attn.context = context
            yield
        finally:
            for block in blocks:
                block.attn.context = {}

    def forward(self, tokens: Any, sigma: Any = None, return_type: str | None = "logits",
                attention_mask: Tensor | None = None, *, x0: Any = None, kv_cache: BD3KVCache | None = None,
                store_kv: bool = False, **unknown: Any) -> Any:
        """Logits of BD3LM at conditioning σ (zeroed inside when `time_conditioning` is off, the released default).

        Args:
            tokens: sampling form: a window `[batch, L]`, L ≤ model_length; training form: x_t `[batch, n]`
                (n = model_length exactly); cached form: one block `[batch, block_size]`.
            sigma: a number or `[batch]` tensor ≥ 0 (may be omitted without time conditioning).
            return_type: as `HookedDDiT.forward` ("log_probs" = SUBS on `tokens`).
            x0: the clean sequence `[batch, n]`: selects the training form (input x_t ⊕ x_0, block-diffusion mask).
            kv_cache: a `BD3KVCache` (`model.new_kv_cache(batch)`): selects the cached form.
            store_kv: with `kv_cache`, keep this block in the cache after the forward.
        """
        refuse_keywords(unknown, (*FORWARD_KEYWORDS, "x0", "kv_cache", "store_kv"), self.cfg)
        return_type = validate.choice(return_type, RETURN_TYPES, name="return_type")
        tokens = check_tokens(tokens, self.cfg, attention_mask)
        store_kv = validate.boolean(store_kv, name="store_kv")
        batch, n, bs = tokens.shape[0], self.cfg.n_ctx, self.cfg.extra["block_size"]
        sigma = check_sigma(sigma, batch, self.cfg, tokens.device)
        full, mask, cos, sin, rows = self._layout(tokens, x0, kv_cache, store_kv)
        c = self.conditioning(sigma)
        resid = self.hook_embed(self.embed(full))
        # `set_autocast(True)`: the research models/dit.py's bf16 autocast around the blocks and the final layer
        # (the hub model runs fp32), as HookedDDiT.forward
        with torch.autocast(device_type=full.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            with self._attention_context(mask=mask, cache=kv_cache):
                for block in self.blocks:
                    resid = block(resid, c, cos, sin)
            if kv_cache is not None and store_kv:
                kv_cache.store()
            if return_type is None:
                return None
            raw = self.unembed(self.hook_final_modulated(self.final_modulate(resid, c)))[:, :rows]
        return finish(raw, tokens.to(raw.device), return_type, self.cfg)

    def _layout(self, tokens: Tensor, x0: Any, cache: BD3KVCache | None, store_kv: bool
                ) -> tuple[Tensor, Tensor | None, Tensor, Tensor, int]:
        """(model input, attention mask or None, cos, sin over the key positions, rows returned)."""
        batch, length = tokens.shape
        n, bs, dev, d = self.cfg.n_ctx, self.cfg.extra["block_size"], tokens.device, self.cfg.d_head
        if x0 is not None and cache is not None:
            raise InputError("x0 (training form) and kv_cache (cached sampling form) exclude each other.",
                             argument="x0", value="given with kv_cache", allowed="one of x0, kv_cache")
        if store_kv and cache is None:
            raise InputError("store_kv=True needs kv_cache=...", argument="store_kv", value=True,
                             allowed="False without a cache")
        if x0 is not None:
            x0 = check_tokens(x0, self.cfg, None)
            if tokens.shape != (batch, n) or x0.shape != (batch, n):
                raise InputError(f"the training form needs x_t and x0 of shape [batch, model_length={n}]; got "
                                 f"{tuple(tokens.shape)} and {tuple(x0.shape)}.", argument="x0",
                                 value=tuple(x0.shape), allowed=f"({batch}, {n})")
            cos, sin = rotary_tables(n, d, self.cfg.rope_theta, dev, compute_dtype(self.cfg.dtype))
            return (torch.cat([tokens, x0], dim=1), block_diff_mask(n, bs, dev), torch.cat([cos, cos]),
                    torch.cat([sin, sin]), n)
        if cache is not None:
            if not isinstance(cache, BD3KVCache) or cache.batch != batch or length != bs:
                raise InputError(f"kv_cache={cache!r} with tokens {tuple(tokens.shape)}: the cached form takes one "
                                 f"block [batch={getattr(cache, 'batch', '?')}, block_size={bs}] and a BD3KVCache of "
                                 "this model (model.new_kv_cache(batch)).", argument="kv_cache", value=cache,
                                 allowed=f"a BD3KVCache and tokens of shape [{getattr(cache, 'batch', batch)}, {bs}]")
            cos, sin = rotary_tables(cache.length, d, self.cfg.rope_theta, dev, compute_dtype(self.cfg.dtype))
            return tokens, None, cos, sin, length
        cos, sin = rotary_tables(length, d, self.cfg.rope_theta, dev, compute_dtype(self.cfg.dtype))
        return tokens, block_causal_mask(length, bs, dev), cos, sin, length

    def __repr__(self) -> str:
        return super().__repr__().replace("HookedDDiT(", "HookedBD3LM(", 1)[:-1] + \
            f", block_size={self.cfg.extra['block_size']})"
