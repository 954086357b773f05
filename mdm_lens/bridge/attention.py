"""The hooked attention function, registered in transformers' attention interface.

transformers calls `fn(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
is_causal=...)` from inside its own attention modules, with q and k already normed and rotated. Ours
exposes TransformerLens hook points there and runs the same maths as transformers:

* fast path: a layer whose scores and pattern nobody hooks goes through transformers' own SDPA
  function (so an unhooked bridge computes exactly what `attn_implementation="sdpa"` computes);
* explicit path: scores = q·kᵀ·scaling (+ mask), softmax in fp32 cast back, z = pattern·v — the
  order of operations of transformers' `eager_attention_forward`, so `hook_pattern` equals eager
  `output_attentions` (to fp32 rounding: the heads sharing a kv head run as one matmul instead of
  over a repeated copy of k and v, and the elementwise steps run in place).

Key axis: every key hook (`hook_rot_k`, `hook_v`, `hook_attn_scores`, `hook_pattern`) is indexed by
absolute position 0..T-1 of the sequence seen so far. A sliding-window layer whose cache dropped old
keys is left-padded: zero keys/values, scores at the dtype's minimum, zero attention. Edits to those
padded slots are discarded (the layer never had those keys).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from mdm_lens.bridge.taps import TapPoint

HOOKED_ATTENTION = "mdm_lens_hooked"
_HOOKS_ATTR = "_mdm_lens_attn_hooks"


def hooked(hp: HookPoint) -> bool:
    """Cheaper than `has_hooks()`: called on every layer of every forward."""
    return bool(hp.fwd_hooks or hp.bwd_hooks)


class AttnHooks(nn.Module):
    """`blocks.{l}.attn.*`: q/k pre-RoPE (after q/k norms where the family has them, own positions),
    `hook_rot_q/rot_k` post-RoPE, `hook_v` (after v_norm), scores, pattern, z."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_q, self.hook_k = TapPoint(), TapPoint()  # read off q/k norms or projections (layers.py)
        for name in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"):
            setattr(self, name, HookPoint())
        self.force_explicit = False  # tests/benchmarks: always take the explicit path
        self.total_keys: int | None = None  # absolute key count of the current pass, set by the bridge

    def needs_explicit(self) -> bool:
        return self.force_explicit or hooked(self.hook_attn_scores) or hooked(self.hook_pattern)


def attach(module: nn.Module, hooks: AttnHooks) -> None:
    # object.__setattr__: a plain reference, not a registered submodule (the hooks live in the
    # bridge's tree under their TL names, not inside transformers' module tree)
    object.__setattr__(module, _HOOKS_ATTR, hooks)


def detach(module: nn.Module) -> None:
    module.__dict__.pop(_HOOKS_ATTR, None)


def _left_pad(x: Tensor, pad: int, dim: int, value: float = 0.0) -> Tensor:
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_full(shape, value), x], dim=dim)


def _causal_visible(q_len: int, k_len: int, window: int | None, device: torch.device) -> Tensor:
    """transformers' causal (and sliding-window) rule with the queries at the end of the keys."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def _grouped_matmul(a: Tensor, b: Tensor) -> Tensor:
    """`a [batch, head, q, ·] @ b [batch, kv_head, ·, n]` → `[batch, head, q, n]`, head j reading kv head
    j // (head / kv_head) (transformers' `repeat_kv` order) without materialising the repeated k or v:
    the heads sharing a kv head are stacked along the rows of one matmul."""
    batch, heads, rows, inner = a.shape
    groups = b.shape[1]
    if groups == heads:
        return torch.matmul(a, b)
    out = torch.matmul(a.reshape(batch, groups, (heads // groups) * rows, inner), b)
    return out.view(batch, heads, rows, out.shape[-1])


def _scores(hooks: AttnHooks, q: Tensor, k: Tensor, mask: Tensor | None, scaling: float, softcap: float | None,
            is_causal: bool, window: int | None, pad: int) -> Float[Tensor, "batch head query key"]:
    # in place where eager allocates: same operations in the same order, so the same bits
    scores = _grouped_matmul(q, k.transpose(2, 3)).mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    low = torch.finfo(scores.dtype).min  # as eager's additive mask: a fully masked row stays uniform, not NaN
    if mask is not None:
        mask = mask[..., : k.shape[2]]
        scores = scores.masked_fill_(~mask, low) if mask.dtype == torch.bool else scores.add_(mask)
    elif is_causal and q.shape[2] > 1:
        scores = scores.masked_fill_(~_causal_visible(q.shape[2], k.shape[2], window, q.device), low)
    return _left_pad(scores, pad, dim=-1, value=low)


def hooked_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, is_causal: bool | None = None,
                             softcap: float | None = None, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """query `[batch, head, query, d_head]`, key/value `[batch, kv_head, key, d_head]` → z `[batch, query, head,
    d_head]` (transformers' convention), pattern or None."""
    hooks: AttnHooks | None = module.__dict__.get(_HOOKS_ATTR)
    if hooks is None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, softcap=softcap, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    k_len = key.shape[2]
    total = hooks.total_keys if hooks.total_keys is not None and hooks.total_keys >= k_len else k_len
    pad = total - k_len
    if hooked(hooks.hook_rot_q):
        query = hooks.hook_rot_q(query.transpose(1, 2)).transpose(1, 2)
    if hooked(hooks.hook_rot_k):
        key = hooks.hook_rot_k(_left_pad(key.transpose(1, 2), pad, dim=1)).transpose(1, 2)[:, :, pad:]
    if hooked(hooks.hook_v):
        value = hooks.hook_v(_left_pad(value.transpose(1, 2), pad, dim=1)).transpose(1, 2)[:, :, pad:]
    if hooks.needs_explicit() or softcap is not None:
        scores = hooks.hook_attn_scores(_scores(hooks, query, key, attention_mask, scaling, softcap, causal,
                                                sliding_window, pad))
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        pattern = hooks.hook_pattern(pattern)[..., pad:]
        z = _grouped_matmul(pattern, value).transpose(1, 2)
    else:
        z, pattern = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                            is_causal=is_causal, **kwargs)
    if hooked(hooks.hook_z):
        z = hooks.hook_z(z)
    return z.contiguous(), pattern


def register() -> str:
    """Register the function (and SDPA's boolean masks for it) under `HOOKED_ATTENTION`; idempotent."""
    AttentionInterface.register(HOOKED_ATTENTION, hooked_attention_forward)
    AttentionMaskInterface.register(HOOKED_ATTENTION, sdpa_mask)
    return HOOKED_ATTENTION
