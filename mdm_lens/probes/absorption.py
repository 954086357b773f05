"""Absorption by layer on the clean final sequence (§1.b, §3.3): the full-sequence attention, the absorption
variants with their uniform nulls, and the query-chunked path for long contexts. Re-exported by :mod:`run`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

from . import floating
from ._ignored import refuse_ignored, refuse_prompt_length
from ._results import ResultMixin
from ._runtools import _attention_mask, _tokens, is_block_diffusion, is_causal, layer_list, sequence_view

__all__ = ["final_attention", "absorption_by_layer", "AbsorptionByLayer", "absorption_from_attention",
           "absorption_from_received", "absorption_chunked", "patterns_exceed_budget", "PATTERN_BUDGET_BYTES"]

# ----------------------------------------------------------------------------------------------
# §1.b / §3.3 full-sequence attention and absorption
# ----------------------------------------------------------------------------------------------

def _no_prompt_length(model: Any, prompt_length: Any) -> None:
    refuse_prompt_length(model, prompt_length, is_block_diffusion(model))


@torch.no_grad()
def final_attention(model: Any, tokens: Int[Tensor, "batch pos"], attention_mask: Tensor | None = None,
                    layers: int | Sequence[int] | None = None,
                    prompt_length: int | None = None) -> Float[Tensor, "batch layer head query key"]:
    """A^l = softmax(q kᵀ/√d_h + mask) of one clean forward (the paper's "full sequence" mode).

    Reads ``blocks.{l}.attn.hook_pattern`` via ``run_with_cache(names_filter=...)``, which forces the
    explicit attention path.  Rows sum to 1 over the visible keys (pad rows under a pair mask are 0).
    Block-diffusion models (DiffusionGemma) need ``prompt_length``: the answer rows are the decoder's
    (bidirectional over prompt + answer), the prompt rows the encoder's own causal attention over the
    prompt (:mod:`mdm_lens.bridge.sequence`); other models refuse it (it would change nothing).
    """
    _no_prompt_length(model, prompt_length)
    tokens = _tokens(tokens, device=model.input_device)
    layer_ids = layer_list(model, layers)
    return _final_attention(model, tokens, _attention_mask(attention_mask, tokens, model, "final_attention"),
                            layer_ids, prompt_length)


def _final_attention(model: Any, tokens: Tensor, am: Tensor | None, layer_ids: list[int],
                     prompt_length: int | None) -> Tensor:
    """:func:`final_attention` of checked arguments (absorption_by_layer's own call: it warned already)."""
    if is_block_diffusion(model):
        view = sequence_view(model, tokens, am, layer_ids, prompt_length, encoder_patterns=True)
        P = view.prompt_length
        rows = []
        for l in layer_ids:
            a = view.cache[f"blocks.{l}.attn.hook_pattern"].clone()
            a[:, :, :P, :P] = view.encoder_patterns[l]
            rows.append(a)
        return torch.stack(rows, dim=1)
    names = [f"blocks.{l}.attn.hook_pattern" for l in layer_ids]
    _, cache = model.run_with_cache(tokens, attention_mask=am, names_filter=names, return_type=None)
    return torch.stack([cache[n] for n in names], dim=1)


@dataclass
class AbsorptionByLayer(ResultMixin):
    """Absorption (percent) per sample, layer and variant, with uniform nulls, and mean ± std over samples.

    ``mode="paper"``: one variant, ``top1`` (MDM: AF Rule A, which always falls back to top-1) or
    ``pos0`` (ARM: column 0).  ``mode="default"``: ``pos0``, ``top1``, ``anchors`` for every model.
    ``std`` is the population std over the batch (numpy's default, as the reference's ``fill_between``).

    ``to_frame()`` columns: ``metric`` (``mean``, ``std``, ``null_mean``, ``excess_mean``; pass
    ``metrics=("per_sample", "n_anchors")`` for per-sample rows with a ``batch`` column), ``layer``,
    ``variant``, ``value`` (percent), ``label``.  :meth:`table` is the wide view.
    """

    mode: str
    causal: bool
    variants: tuple[str, ...]
    layers: list[int]
    per_sample: Tensor          # [batch, layer, variant]
    null: Tensor                # [batch, layer, variant]  uniform-attention value under the same visibility
    excess: Tensor              # [batch, layer, variant]  per_sample − null
    n_anchors: Tensor           # [batch, layer]           |S| (head="mean"), mean over heads (head="each")
    mean: Tensor                # [layer, variant]
    std: Tensor                 # [layer, variant]
    null_mean: Tensor           # [layer, variant]
    excess_mean: Tensor         # [layer, variant]
    # block-causal models (LLaDA2.x, SDAR): the block length of the mask the attention ran under; the nulls are
    # then uniform attention under that mask (each query over its own and earlier blocks), not 100/n
    block_length: int | None = None

    _dims: ClassVar = {"mean": ("layer", "variant"), "std": ("layer", "variant"),
                       "null_mean": ("layer", "variant"), "excess_mean": ("layer", "variant"),
                       "per_sample": ("batch", "layer", "variant"), "n_anchors": ("batch", "layer")}

    def _coords(self):
        return {"variant": list(self.variants), "layer": list(self.layers)}

    def to_frame(self, lead_dims=None, metrics=("mean", "std", "null_mean", "excess_mean")):
        return super().to_frame(lead_dims=lead_dims, metrics=metrics)

    def table(self) -> pd.DataFrame:
        """Wide summary: one row per layer (index ``layer``, the model's layer number) and, for each variant
        in ``variants`` (default mode: ``pos0``, ``top1``, ``anchors`` → 12 columns; paper mode: one → 4):

        - ``{v}``: mean over samples of Absorb_v (percent of the received mass on S_v);
        - ``{v}_std``: population std over samples (0 for one sample);
        - ``{v}_null``: mean uniform-attention null under the same visibility (100/n bidirectional,
          100·H_n/n causal for pos0/top1; the uniform mass on S for anchors);
        - ``{v}_excess``: mean of value − null (percentage points).
        """
        df = self.to_frame()
        wide = df.pivot_table(index="layer", columns=["variant", "metric"], values="value")
        wide.columns = [v if m == "mean" else f"{v}_{m.replace('_mean', '')}" for v, m in wide.columns]
        order = [c for v in self.variants for c in (v, f"{v}_std", f"{v}_null", f"{v}_excess") if c in wide.columns]
        return wide[order]


def _absorption_from_received(received: Tensor, key_visible: Tensor | None, causal: bool, mode: str,
                              rule: str, block_length: int | None = None
                              ) -> tuple[tuple[str, ...], Tensor, Tensor, Tensor]:
    """(variants, values [..., variant], nulls [..., variant], n_anchors [...]) from mass received attention."""
    if mode == "paper":
        if causal:
            res = floating.absorption_variants(received, key_visible, causal=True)
            return ("pos0",), res.pos0[..., None], res.null_pos0[..., None], torch.ones_like(res.pos0)
        s = floating.detect_anchors(received, rule="paper_absorption", key_visible=key_visible)
        res = floating.absorption_variants(received, key_visible, causal=False, anchors=s,
                                           block_length=block_length)
        return ("top1",), res.anchors[..., None], res.null_anchors[..., None], res.n_anchors.to(torch.float64)
    res = floating.absorption_variants(received, key_visible, causal=causal, rule=rule, block_length=block_length)
    names = ("pos0", "top1", "anchors")
    vals = torch.stack([getattr(res, n) for n in names], -1)
    nulls = torch.stack([getattr(res, f"null_{n}") for n in names], -1)
    return names, vals, nulls, res.n_anchors.to(torch.float64)


@validate.known_keywords
def absorption_by_layer(model: Any, tokens: Int[Tensor, "batch pos"], attention_mask: Tensor | None = None,
                        mode: Literal["default", "paper"] = "default", rule: str = "zscore",
                        head: Literal["mean", "each"] = "mean",
                        layers: int | Sequence[int] | None = None,
                        prompt_length: int | None = None, chunked: bool | None = None) -> AbsorptionByLayer:
    """Absorb(S, l) = 100 · Σ_{j∈S} m^l_j on the clean final sequence, per sample and layer (§1.b, §3.3).

    m^l_j = (1/|Q|) Σ_{i∈Q} Ā^l_ij with Ā the head-mean attention and Q all non-pad rows.
    ``paper``: MDM S = AF Rule A (``paper_absorption`` ⇒ top-1), ARM S = {column 0} (the first real
    token).  ``default``: the three variants pos0 / top1 / anchors (``rule``, zscore by default), each
    with its uniform null (bidirectional 100/n; causal pos0/top1 100·H_n/n) and excess = value − null.
    ``head="each"`` (default mode only; refused with ``mode="paper"``, as is a ``rule`` other than zscore, which
    paper mode would ignore) computes per head and averages the percentages over heads.
    Block-diffusion models (DiffusionGemma, ``prompt_length`` required): Q = the answer rows, i.e. the decoder's
    queries, over the keys each decoder layer lets them see (prompt + answer; a sliding layer only the last
    window − 1 prompt keys), which also set the nulls.
    ``chunked``: sum the received mass over query chunks inside the attention (row consumers) instead of
    holding every ``[batch, head, T, T]`` pattern: memory O(T·chunk), equal to the pattern path to float64
    rounding. None (default) = chunked when the float64 patterns of the requested layers would exceed
    ``PATTERN_BUDGET_BYTES`` (256 MiB), so short inputs keep the pattern path's exact bits.
    """
    mode = validate.choice(mode, ("default", "paper"), name="mode")
    rule = validate.choice(rule, floating.RULES, name="rule")
    head = validate.choice(head, ("mean", "each"), name="head")
    check_paper_arguments(mode, rule, head)
    layer_ids = layer_list(model, layers)
    if chunked is not None:
        validate.boolean(chunked, name="chunked")
    _no_prompt_length(model, prompt_length)
    if is_block_diffusion(model):
        if chunked:  # the decoder's rows come from its patterns; no row-consumer path through the bridge yet
            raise ArgumentError("chunked=True is not available on a block-diffusion model: its absorption reads the "
                                "decoder patterns of one forward.", argument="chunked", value=True,
                                allowed="None or False on DiffusionGemma")
        toks = _tokens(tokens, device=model.input_device)
        view = sequence_view(model, toks, _attention_mask(attention_mask, toks, model, "absorption_by_layer"),
                             layer_ids, prompt_length)
        attn = torch.stack([view.cache[f"blocks.{l}.attn.hook_pattern"] for l in layer_ids], dim=1)
        kv = torch.stack([view.key_visible[l] for l in layer_ids], dim=1)           # [batch, layer, key]
        return absorption_from_attention(model, attn, toks, attention_mask, mode, rule, head, layer_ids,
                                         query_rows=view.query_rows, key_visible=kv)
    toks = _tokens(tokens, device=model.input_device)
    am = _attention_mask(attention_mask, toks, model, "absorption_by_layer")
    if chunked is None:
        chunked = patterns_exceed_budget(model, toks.shape, len(layer_ids))
    if validate.boolean(chunked, name="chunked"):
        return absorption_chunked(model, toks, am, mode, rule, head, layer_ids)
    attn = _final_attention(model, toks, am, layer_ids, None)
    return absorption_from_attention(model, attn, toks, attention_mask, mode, rule, head, layer_ids)


def check_paper_arguments(mode: str, rule: str, head: str) -> None:
    """Paper mode has one anchor set (AF Rule A, or column 0 on an ARM) and the head-mean attention: a `rule` or
    `head="each"` there would be silently ignored, so it is refused."""
    if mode == "paper":
        refuse_ignored("head", head, "mean", by="mode", by_value="paper", why="the paper's absorption reads the "
                       "head-mean attention (per head is default-mode only)")
        refuse_ignored("rule", rule, "zscore", by="mode", by_value="paper", why="the paper's anchor set is AF Rule "
                       "A (top-1; column 0 on an ARM), whatever the rule")


PATTERN_BUDGET_BYTES = 256 * 2 ** 20  # above this, whole-pattern statistics reduce over query chunks instead


def patterns_exceed_budget(model: Any, shape: Sequence[int], n_layers: int) -> bool:
    """Would ``n_layers`` float64 patterns ``[batch, head, T, T]`` of tokens ``shape`` exceed the budget?"""
    batch, T = shape
    return batch * n_layers * model.cfg.n_heads * T * T * 8 > PATTERN_BUDGET_BYTES


def absorption_chunked(model: Any, tokens: Tensor, am: Tensor | None, mode: str, rule: str, head: str,
                       layer_ids: list[int], received: Tensor | None = None) -> AbsorptionByLayer:
    """:func:`absorption_by_layer` without patterns: the received mass of one forward, reduced over query chunks
    inside the attention (``hooks.reducers.received_by_layer``; pass ``received`` to reuse one)."""
    from mdm_lens.hooks.reducers import received_by_layer

    check_paper_arguments(mode, rule, head)  # before the forward
    if received is None:
        received = received_by_layer(model, tokens, am, layers=layer_ids)           # [b, l, h, T] float64
    received = validate.finite(received, name="received attention")
    per_head = head == "each"
    return absorption_from_received(model, received if per_head else received.mean(2),
                                    None if am is None else am.bool(), mode, rule, per_head, layer_ids)


def absorption_from_attention(model: Any, attn: Float[Tensor, "batch layer head query key"], tokens: Tensor,
                              attention_mask: Tensor | None, mode: str, rule: str, head: str,
                              layer_ids: list[int], query_rows: Tensor | None = None,
                              key_visible: Tensor | None = None) -> AbsorptionByLayer:
    """:func:`absorption_by_layer` from ``attn = final_attention(model, tokens, attention_mask, layer_ids)``
    (arguments already checked), so one forward can serve both modes (the sweep does). ``query_rows``
    ``[batch, query]`` / ``key_visible`` ``[batch, layer, key]``: the query set and per-layer key sets where
    they are not "every non-pad row / key" (block-diffusion models)."""
    check_paper_arguments(mode, rule, head)
    attn = attn.to(torch.float64)                                                        # [b, l, h, q, k]
    if key_visible is None:
        kv = _attention_mask(attention_mask, _tokens(tokens, device=attn.device))
        kv = None if kv is None else kv.bool()
    else:
        kv = key_visible.to(attn.device)
    causal = is_causal(model)
    per_head = head == "each" and mode == "default"
    pattern = attn if per_head else attn.mean(2)
    kvb = None if kv is None else floating.align_mask(kv, pattern.ndim - 1, batch_dim=0)
    qm = None if query_rows is None else floating.align_mask(query_rows.to(attn.device), pattern.ndim - 1,
                                                             batch_dim=0)
    received = floating.received_attention(pattern, query_mask=qm, key_visible=kvb, causal=causal)
    return absorption_from_received(model, received, kv, mode, rule, per_head, layer_ids)


def absorption_from_received(model: Any, received: Float[Tensor, "batch layer *head key"], kv: Tensor | None,
                             mode: str, rule: str, per_head: bool, layer_ids: list[int]) -> AbsorptionByLayer:
    """The absorption variants from the received mass ``[batch, layer, (head,) key]`` and the key visibility
    ``kv`` (``[batch, key]`` or per layer ``[batch, layer, key]``; None = all keys)."""
    causal = is_causal(model)
    received = received.to(torch.float64)
    kvb = None if kv is None else floating.align_mask(kv.to(received.device), received.ndim, batch_dim=0)
    block = model.cfg.extra.get("block_length")  # block-causal families: the forward ran under the block mask
    names, vals, nulls, n_anc = _absorption_from_received(received, kvb, causal, mode, rule, block)
    if per_head:
        vals, nulls, n_anc = vals.mean(2), nulls.mean(2), n_anc.mean(2)
    ex = vals - nulls
    std = lambda x: x.std(0, unbiased=False) if x.shape[0] > 1 else torch.zeros_like(x[0])  # noqa: E731
    return AbsorptionByLayer(mode=mode, causal=causal, variants=names, layers=layer_ids,
                             per_sample=vals, null=nulls, excess=ex, n_anchors=n_anc, mean=vals.mean(0),
                             std=std(vals), null_mean=nulls.mean(0), excess_mean=ex.mean(0), block_length=block)
