"""``qk_at_layer`` at every layer from ONE clean forward of a batch's final sequences, bit-identical to the
public probe called once per layer. (The other shared forward, one ``probes.run.final_attention`` per layer
group for absorption in both modes and flow, is ``adapter.attention_tables``.)

``qk_at_layer(l)`` hooks ``hook_pattern`` at layer l only, so its layers below l take the SDPA path and layer
l the explicit one. Here every layer takes the SDPA path for z (``row_mode="sdpa"`` while the row consumers
are attached, restored afterwards), so the inputs of every layer are those of the plain forward, and each
layer's pattern is rebuilt by the attention's own ``PatternRows`` from the same q, k and mask with the
explicit path's operations (``masked_scores`` + ``softmax_rows`` over all query rows at once). Layer l's
rot_q / rot_k / v / pattern are therefore those of ``qk_at_layer(l)``'s forward, bit for bit
(tests/test_sweep.py checks every value against ``qk_at_layer``). Layer l is decomposed while the forward
goes on, so memory stays that of one ``qk_at_layer`` call. Attention modules that cannot stream rows (the
transformers bridge) fall back to one ``qk_at_layer`` per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mdm_lens import pattern_rows as PR
from mdm_lens.probes import qk as QK
from mdm_lens.probes import run as R

__all__ = ["qk_all_layers", "streams_rows"]


class _QKAtLayer(PR.RowConsumer):
    """Decomposes one layer as soon as its pattern is known (its rot_q / rot_k / v hooks ran before), so only
    one layer's pattern and activations are held at a time, as in ``qk_at_layer``."""

    def __init__(self, model: Any, layer: int, acts: dict[str, Tensor], query_mask: Tensor | None,
                 key_visible: Tensor | None):
        self.model, self.layer, self.acts, self.qm, self.kv = model, layer, acts, query_mask, key_visible
        self.result: QK.QKDecomposition | None = None

    def start(self, rows: PR.PatternRows) -> None:
        self.rows, self.parts = rows, []

    def consume(self, pattern: Tensor, start: int) -> None:
        self.parts.append((start, pattern))

    def finish(self) -> None:
        rows, parts = self.rows, self.parts
        del self.rows, self.parts
        whole = len(parts) == 1 and parts[0][0] == 0 and parts[0][1].shape[2] == rows.n_queries
        # Several chunks: recompute all rows at once so every value comes from the explicit path's exact ops.
        pattern = parts[0][1] if whole else rows.rows(0, rows.n_queries)
        a = {h: self.acts.pop(f"blocks.{self.layer}.attn.{h}") for h in ("hook_rot_q", "hook_rot_k", "hook_v")}
        self.result = R.qk_from_activations(self.model, a["hook_rot_q"], a["hook_rot_k"], a["hook_v"], pattern, None,
                                            self.qm, self.kv)


def streams_rows(model: Any) -> bool:
    """Every attention can feed row consumers and build z with SDPA meanwhile (``HookedMDM``)."""
    return all(hasattr(b.attn, "add_row_consumer") and hasattr(b.attn, "row_mode") for b in model.blocks)


@torch.no_grad()
def qk_all_layers(model: Any, tokens: Tensor, attention_mask: Tensor | None) -> list[QK.QKDecomposition]:
    """``[qk_at_layer(model, tokens, l, attention_mask=attention_mask) for l in layers]`` (default anchor,
    query, rule and share) from one forward; see the module doc."""
    n = model.cfg.n_layers
    if not streams_rows(model):
        return [R.qk_at_layer(model, tokens, l, attention_mask=attention_mask) for l in range(n)]
    tokens = R._tokens(tokens, device=model.input_device)
    am = R._attention_mask(attention_mask, tokens)
    kv = None if am is None else am.bool()
    qm = R._query_mask(model, tokens, "all", kv)
    acts: dict[str, Tensor] = {}

    def save(t: Tensor, hook: Any) -> None:
        acts[hook.name] = t.detach()

    layers = [_QKAtLayer(model, l, acts, qm, kv) for l in range(n)]
    hooks: list[tuple[str, Any]] = []
    for l in range(n):
        hooks += [(f"blocks.{l}.attn.{h}", save) for h in ("hook_rot_q", "hook_rot_k", "hook_v")]
        hooks.append(PR.row_hook(model, l, layers[l]))
    attns = [b.attn for b in model.blocks]
    modes = [a.row_mode for a in attns]
    try:
        for a in attns:
            a.row_mode = "sdpa"
        with model.hooks(fwd_hooks=hooks):
            model(tokens, attention_mask=am, return_type=None)
    finally:
        for a, m in zip(attns, modes):
            a.row_mode = m
    return [c.result for c in layers]
