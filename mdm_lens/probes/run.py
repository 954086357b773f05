"""Adapters from model runs (one clean forward, or a sampler's ``GenerateOutput``) to the tensor probes
of :mod:`floating`, :mod:`qk` and :mod:`flow` (spec §1.b, §3.3, §3.4, §3.6, §3.8).

The tensor probes are shape-generic and know nothing about models; this module does the plumbing:
which hook to read, which axis is which, which keys are visible at which step, which query row reads
out which position.  Conventions shared by :mod:`retrieval` and :mod:`patching`:

- *readout row* q(p) of position p: the hidden state whose logits emit token p.  q(p) = p for
  unshifted MDMs (LLaDA); q(p) = p − 1 for ``cfg.logit_shift`` models (Dream) and for causal ARMs
  (the token at p is emitted by the query at p − 1).  See :func:`readout_shift`.
- sampler records are ``[step, batch, layer, head, key]``; the floating probes want ``[..., step, key]``,
  so :func:`anchors_over_steps` permutes to ``[batch, layer, (head,) step, key]``.
- keys that do not exist at a step (ARM: beyond the prefix ``prompt + s``) or are padding are NaN in
  the received-attention series, which both ``detect_anchors`` and ``drift`` treat as invisible.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import pandas as pd
import torch
from einops import rearrange
from jaxtyping import Bool, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion.fixed_length import require_fixed_length
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError
from mdm_lens.hooks.record_steps import record_steps

from . import _checks as C
from . import flow as F
from ._runtools import (_attention_mask, _batch, _nonempty, _optional_length, _tokens, generate_final,  # noqa: F401
                        is_block_diffusion, is_causal, layer_list, readout_shift, sequence_view, step_canvas,
                        step_forward_kwargs)
from . import floating, qk
from ._ignored import refuse_ignored, refuse_prompt_length
from ._results import ResultMixin, to_numpy

__all__ = ["final_attention", "absorption_by_layer", "AbsorptionByLayer", "anchors_over_steps", "StepAnchors",
           "drift_from_output", "qk_at_layer", "regions_for_item", "flow_for_items", "ItemFlows",
           "generate_final", "readout_shift", "step_canvas", "step_forward_kwargs", "layer_list", "is_causal"]


from .absorption import (PATTERN_BUDGET_BYTES, AbsorptionByLayer, absorption_by_layer,  # noqa: F401,E402
                         absorption_chunked, absorption_from_attention, absorption_from_received, final_attention,
                         patterns_exceed_budget)

# ----------------------------------------------------------------------------------------------
# §3.4 anchors and drift over the steps of a run
# ----------------------------------------------------------------------------------------------

class UndefinedSeriesWarning(UserWarning):
    """A received-attention series with no finite value: its anchor sets are undefined (no data), not empty."""


@dataclass
class StepAnchors(ResultMixin):
    """Anchor sets S_s and received attention over steps, ``[batch, layer, (head,) step, key]``.

    The layer axis is dropped when a single ``layer`` was asked for.  ``received`` is NaN at keys that
    are padding or do not exist yet at that step (ARM prefixes); ``key_visible`` says which keys exist.
    ``steps`` are the run's step indices of the step axis.  ``to_frame()`` columns: ``metric``
    (``anchors`` 0/1, ``received`` mass), the leading dims (``batch``, ``layer``, ``head``), ``step`` (the
    position on the step axis), ``key``, ``value``, ``label``.
    """

    anchors: Tensor
    received: Tensor
    key_visible: Tensor         # [batch, step, key]
    steps: list[int]
    layers: list[int]
    rule: str
    head: Any
    causal: bool
    lead_dims: tuple[str, ...] = ()

    _dims: ClassVar = {"anchors": ("step", "key"), "received": ("step", "key")}

    def to_frame(self, lead_dims=None, metrics=None):
        return super().to_frame(lead_dims=lead_dims or self.lead_dims, metrics=metrics)


def _step_visibility(out: Any, steps: Sequence[int], n_keys: int) -> Bool[Tensor, "batch step key"]:
    """Key j exists and is not padding at step s (ARM: j < prompt_length + s)."""
    am = out.attention_mask.bool().cpu()[:, :n_keys]
    if am.shape[1] < n_keys:  # a block sampler's canvas tail (past prompt + gen_length): canvas keys, no padding
        am = torch.cat([am, am.new_ones((am.shape[0], n_keys - am.shape[1]))], dim=1)
    vis = am[:, None, :].expand(am.shape[0], len(steps), n_keys).clone()
    if out.causal:
        pos = torch.arange(n_keys)
        limit = out.prompt_length + torch.tensor(list(steps))
        vis &= pos[None, :] < limit[:, None]
    return vis


def _record(out: Any, record: Any) -> Tensor:
    if not hasattr(out, "records") or not hasattr(out, "trajectory"):
        raise ArgumentTypeError(f"out={validate.describe(out)} is invalid: expected the GenerateOutput of a run "
                                "(model.generate(..., record=[ReceivedAttention()])).", argument="out", value=out,
                                allowed="a GenerateOutput")
    names = list(getattr(out, "records", {}) or {})
    meta = getattr(out, "record_meta", {}) or {}
    held = [n for n in names if meta.get(n, {}).get("kind") in ("mass", "cumulative")]
    if isinstance(record, str) and record not in names and held:  # received attention under its own name= : use it
        raise ArgumentError(f"this run recorded no {record!r}, but {held} hold(s) received attention (a named "
                            f"ReceivedAttention): pass record={held[0]!r}.", argument="record", value=record,
                            allowed=f"a record of the run: {names}")
    if isinstance(record, str) and record not in names:  # the run recorded nothing under that name: say how to
        raise ArgumentError(f"this run recorded no {record!r} (its records: {names or 'none'}): generate it with "
                            "record=[ReceivedAttention()] (mdm_lens.hooks.reducers), e.g. model.generate(prompt, "
                            "record=[ReceivedAttention()]).", argument="record", value=record,
                            allowed=f"a record of the run: {names}" if names else "a run generated with record=")
    validate.choice(record, names, name="record")
    rec = out.records[record]
    if not isinstance(rec, Tensor) or rec.ndim != 5:
        raise ArgumentError(f"record={record!r} is not a [step, batch, layer, head, key] record (shape "
                            f"{tuple(getattr(rec, 'shape', ()))}); record ReceivedAttention().", argument="record",
                            value=record, allowed="a ReceivedAttention record")
    return rec


def _recorded_layer(layer: Any, rec_layers: list[int], n_layers: int | None) -> int:
    """A model layer that was recorded; a negative value counts from the end of the model's layers, as everywhere
    (-1 on a record of layers [2] of a 4-layer model is layer 3, not recorded, not layer 2)."""
    if not validate._is_int(layer):  # raises the typed error, with the model's layer range
        validate.index(layer, n_layers if n_layers is not None else len(rec_layers), name="layer", what="layer")
    layer = given = int(layer)
    if layer < 0:
        if n_layers is None and rec_layers != list(range(len(rec_layers))):
            raise C.OutOfRangeError(f"layer={layer} is ambiguous: this run does not say how many layers its model has "
                                    f"and its record holds layers {rec_layers}; pass one of them.",
                                    argument="layer", value=layer, allowed=f"one of {rec_layers}")
        layer = validate.index(layer, n_layers if n_layers is not None else len(rec_layers), name="layer",
                               what="layer")
    if layer not in rec_layers:
        shown = f"layer={given}" + ("" if given == layer else f" (model layer {layer})")
        raise C.OutOfRangeError(f"{shown} is invalid: it was not recorded; recorded layers: {rec_layers}.",
                                argument="layer", value=given, allowed=f"one of {rec_layers}")
    return layer


def _series(out: Any, layer: int | None, head: Any, record: str) -> tuple[Tensor, Tensor, list[int], list[int], tuple]:
    require_fixed_length(out, "anchors_over_steps / drift_from_output", "the received-attention series of key "
                         "column j would join different tokens across steps (a row inserted at step s would continue "
                         "the series of the row it displaced), and anchor persistence would count those as one key")
    rec = _record(out, record)                                             # [step, batch, layer, head, key]
    # a block sampler's record covers its whole canvas; keys past prompt + gen_length (the last block's tail) are
    # canvas, not answer, and the trajectory (commit steps) stops there: they are left out here
    rec = rec[..., :out.tokens.shape[1]]
    meta = out.record_meta.get(record, {})
    if meta.get("kind") != "mass":  # the anchor rules' thresholds are shares of one query's unit mass
        what = (f"a {meta['kind']!r} ReceivedAttention record (column sums over the queries, not a distribution "
                "over keys)" if "kind" in meta else f"not a ReceivedAttention record (axes {meta.get('axes')})")
        raise InputError(f"record={record!r} is {what}; the anchor rules' thresholds are for mass records: record "
                         "ReceivedAttention() (kind='mass') and pass its name.", argument="record",
                         value=record, allowed="a kind='mass' received-attention record")
    rec_layers = list(meta.get("layers", range(rec.shape[2])))
    steps = record_steps(out, record, rec.shape[0])
    if layer is not None:
        key = getattr(out, "model_key", None)
        want = _recorded_layer(layer, rec_layers, int(key[2]) if key else None)
        rec, rec_layers = rec[:, :, [rec_layers.index(want)]], [want]
    r = rearrange(rec.to(torch.float64), "s b l h k -> b l h s k")
    lead = ("batch", "layer", "head")
    if isinstance(head, str):
        head = validate.choice(head, ("mean", "each"), name="head")
    else:
        head = validate.index(head, r.shape[2], name="head", what="head")
    if head == "mean":
        r, lead = r.mean(2), ("batch", "layer")
    elif isinstance(head, int):
        r, lead = r[:, :, head], ("batch", "layer")
    vis = _step_visibility(out, steps, r.shape[-1])
    # Reducers record keys that do not exist yet at a step (a later canvas of a block-diffusion run) as NaN in
    # every layer and head: those keys are invisible there, not non-finite statistics.
    vis &= ~rearrange(rec.isnan().all(dim=3).all(dim=2), "s b k -> b s k")
    undefined = (~vis.any(-1).any(-1)).nonzero().flatten().tolist()
    if undefined:  # empty anchor sets there mean "no data", not "no anchors": said, and NaN in drift_from_output
        warnings.warn(f"record {record!r} has no finite received attention for batch row(s) {undefined} (e.g. a query "
                      "set with no rows in this run): their anchor sets are undefined, not empty; drift_from_output "
                      "reports NaN persistence there.", UndefinedSeriesWarning, stacklevel=4)
    vis_b = vis.reshape(vis.shape[0], *([1] * (r.ndim - 3)), *vis.shape[1:])
    r = torch.where(vis_b, r, torch.full_like(r, torch.nan))
    if layer is not None:
        r, lead = r.squeeze(1), tuple(d for d in lead if d != "layer")
    return r, vis, steps, rec_layers, lead


_DETECT_KWARGS = ("eps", "floor", "k", "kind", "nan_policy")


def _known_detect_kwargs(kwargs: dict) -> None:
    """`**detect_kwargs` go to `floating.detect_anchors`; a misspelt one is a typed error naming the choices."""
    for name in kwargs:
        validate.choice(name, _DETECT_KWARGS, name="detect_kwargs")


def anchors_over_steps(out: Any, layer: int | None = None, rule: str = "zscore", head: Any = "mean",
                       record: str = "received_attention", eps: float | None = None, **detect_kwargs: Any) -> StepAnchors:
    """S_s = detect_anchors(r(s)) at every recorded step of a run (§3.2 on ``ReceivedAttention`` records).

    ``record`` names a ``[step, batch, layer, head, key]`` mass record.  ``head="mean"`` averages the
    per-head received attention (= received attention of the head-mean pattern), an int picks one head,
    ``"each"`` keeps a head axis (a negative int counts from the last head).  ``layer`` is a model layer
    that was recorded (a negative value counts from the end of the *recorded* layers, so −1 = the last
    recorded one); an unrecorded or out-of-range layer raises ``OutOfRangeError``.  ``detect_kwargs``
    (``floor``, ``k``, ``kind``, ``nan_policy``) go to :func:`floating.detect_anchors`.
    """
    rule = validate.choice(rule, floating.RULES, name="rule")
    r, vis, steps, layers, lead = _series(out, layer, head, record)
    vis_b = vis.reshape(vis.shape[0], *([1] * (r.ndim - 3)), *vis.shape[1:])
    _known_detect_kwargs(detect_kwargs)
    anchors = floating.detect_anchors(r, rule=rule, eps=eps, causal=out.causal, key_visible=vis_b, **detect_kwargs)
    return StepAnchors(anchors=anchors & vis_b, received=r, key_visible=vis, steps=steps, layers=layers,
                       rule=rule, head=head, causal=out.causal, lead_dims=lead)


def drift_from_output(out: Any, layer: int | None = None, rule: str = "zscore", head: Any = "mean",
                      record: str = "received_attention", **detect_kwargs: Any) -> floating.DriftResult:
    """``floating.drift`` of the anchor sets of one run (§3.4), with anchor types from ``commit_step``.

    Leading shape ``[batch, (layer,) (head,)]`` as in :func:`anchors_over_steps`.  Anchor types are
    only reported when every step was recorded (otherwise the step axis is not the run's step index).
    """
    _known_detect_kwargs(detect_kwargs)
    sa = anchors_over_steps(out, layer, rule, head, record, **detect_kwargs)
    commit = None
    if sa.steps == list(range(out.n_steps)):
        cs = out.trajectory.commit_step[:, : sa.received.shape[-1]]
        # -2 = never committed (the run ended with the position still masked: BD3LM's first hitting with fewer
        # steps than a block's masks, LLaDA2 after EOS): masked at every step, as a commit after the last one
        cs = torch.where(cs == -2, out.n_steps, cs)
        commit = cs.reshape(cs.shape[0], *([1] * (sa.received.ndim - 3)), cs.shape[-1])
    vis_b = sa.key_visible.reshape(sa.key_visible.shape[0], *([1] * (sa.received.ndim - 3)), *sa.key_visible.shape[1:])
    result = floating.drift(sa.anchors, sa.received, commit_step=commit, step_visible=vis_b)
    result.lead_dims = sa.lead_dims  # the table's columns named as anchors_over_steps' (batch, layer, head)
    return result


# ----------------------------------------------------------------------------------------------
# §3.6 QK decomposition at one layer
# ----------------------------------------------------------------------------------------------

QUERY_SETS: tuple[str, ...] = ("all", "masked", "unmasked")


def _query_mask(model: Any, tokens: Tensor, query: Any, key_visible: Tensor | None) -> Tensor | None:
    if isinstance(query, Tensor):
        qm = C.mask(_batch(query, tokens.device), name="query", size=tokens.shape[-1], against=tokens.shape)
        return qm.expand(tokens.shape)
    query = validate.choice(query, QUERY_SETS, name="query")
    base = torch.ones_like(tokens, dtype=torch.bool) if key_visible is None else key_visible
    if query == "all":
        return None if key_visible is None else base
    if model.cfg.mask_token_id is None:
        raise ArgumentError(f"query={query!r}: {model.cfg.model_name} has no mask token (uniform-state), so a token "
                            "sequence does not say which positions are noisy; pass a [batch, pos] bool mask.",
                            argument="query", value=query, allowed="'all' or a bool mask")
    is_mask = tokens == model.cfg.mask_token_id
    return base & is_mask if query == "masked" else base & ~is_mask


def _anchor_from_pattern(pattern: Tensor, query_mask: Tensor | None, key_visible: Tensor | None, causal: bool,
                         rule: str) -> Int[Tensor, "batch"]:
    """Top-1 received key of the head-mean pattern, or the most-attended ``rule`` anchor (top-1 if none)."""
    rec = floating.received_attention(pattern.mean(1).to(torch.float64), query_mask=query_mask,
                                      key_visible=key_visible, causal=causal)
    masked = rec if key_visible is None else rec.masked_fill(~key_visible, -torch.inf)
    top1 = masked.argmax(-1)
    if rule == "top1":
        return top1
    anc = floating.detect_anchors(rec, rule=rule, key_visible=key_visible, causal=causal)
    if not bool(anc.any(-1).all()):
        warnings.warn(f"qk_at_layer: no {rule} anchor in some rows; using the top-1 key there", stacklevel=4)
    best = masked.masked_fill(~anc, -torch.inf).argmax(-1)
    return torch.where(anc.any(-1), best, top1)


@torch.no_grad()
def qk_at_layer(model: Any, tokens: Int[Tensor, "batch pos"], layer: int, anchor: Any = None, query: Any = "all",
                attention_mask: Tensor | None = None, rule: str = "top1", share: float = 0.8,
                prompt_length: int | None = None) -> qk.QKDecomposition:
    """§3.6 norm/angle split of the anchor key's QK advantage at one layer of one clean forward.

    Reads post-RoPE ``hook_rot_q`` / ``hook_rot_k`` and ``hook_v`` (for ‖v*‖ / mean ‖v‖).  ``anchor``:
    an int / ``[batch]`` / ``[batch, head]`` tensor, or None → detected on the head-mean pattern of the
    same layer over the query set: ``rule="top1"`` (most received key) or e.g. ``"zscore"`` (the most
    received zscore anchor, top-1 where there is none).  ``query``: "all", "masked", "unmasked" or a mask.
    Block-diffusion models (DiffusionGemma; ``prompt_length`` required, refused elsewhere): the queries are the
    decoder's (the answer rows; "all" = every answer row, or a mask inside them; a clean forward has no masked
    rows), the keys those the layer lets them see. Block-causal models (SDAR, LLaDA2.x, Fast-dLLM v2, BD3LM): R_i
    holds the keys query i sees under the block mask the clean forward ran (`cfg.extra["block_length"]`).
    """
    tokens = _tokens(tokens, device=model.input_device)
    l = validate.index(layer, model.cfg.n_layers, name="layer", what="layer")
    share = validate.number(share, name="share", min=0.5, max=1)
    rule = validate.choice(rule, ("top1",) + floating.RULES, name="rule")
    am = _attention_mask(attention_mask, tokens, model, "qk_at_layer")
    kv = None if am is None else am.bool()
    if anchor is not None:  # a named rule or explicit positions: `rule` would pick nothing
        refuse_ignored("rule", rule, "top1", by="anchor", by_value=anchor if isinstance(anchor, (str, int)) else validate.describe(anchor),
                       why="rule picks the anchor only when anchor=None")
    if isinstance(anchor, str):
        anchor = validate.choice(anchor, ("top1",) + floating.RULES, name="anchor")
    elif anchor is not None and not isinstance(anchor, Tensor):
        anchor = validate.index(anchor, tokens.shape[1], name="anchor", what="position")
    if is_block_diffusion(model):
        return _qk_block_diffusion(model, tokens, l, anchor, query, am, rule, share, prompt_length)
    refuse_prompt_length(model, prompt_length, is_block_diffusion(model))
    qm_check = _query_mask(model, tokens, query, kv)                       # validate before the forward
    if qm_check is not None and not bool(qm_check.any(-1).all()):
        raise ArgumentError(f"query={query if isinstance(query, str) else 'mask'!r} selects no query position in "
                            "some batch rows.", argument="query", value=query, allowed="a non-empty query set")
    pre = f"blocks.{l}.attn."
    names = [pre + n for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    _, cache = model.run_with_cache(tokens, attention_mask=am, names_filter=names, return_type=None)
    return qk_from_activations(model, cache[pre + "hook_rot_q"], cache[pre + "hook_rot_k"], cache[pre + "hook_v"],
                               cache[pre + "hook_pattern"], anchor, qm_check, kv, rule, share)


def _qk_block_diffusion(model: Any, tokens: Tensor, l: int, anchor: Any, query: Any, am: Tensor | None, rule: str,
                        share: float, prompt_length: Any) -> qk.QKDecomposition:
    if isinstance(query, str) and query != "all":
        raise ArgumentError(f"query={query!r}: a clean forward of a block-diffusion model has no masked (not yet "
                            "accepted) rows; pass 'all' (every answer row) or a [batch, pos] mask inside the answer.",
                            argument="query", value=query, allowed="'all' or a bool mask")
    names = ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")
    view = sequence_view(model, tokens, am, [l], prompt_length, hooks=names)
    qm = view.query_rows
    if isinstance(query, Tensor):
        sub = C.mask(_batch(query, tokens.device), name="query", size=tokens.shape[-1], against=tokens.shape)
        if bool((sub & ~qm).any()):
            raise ArgumentError("query selects prompt rows: on a block-diffusion model only the answer rows (the "
                                f"decoder's queries, positions >= {view.prompt_length}) have a QK score.",
                                argument="query", value=query, allowed=f"a mask inside positions >= {view.prompt_length}")
        qm = qm & sub
    if not bool(qm.any(-1).all()):
        raise ArgumentError("query selects no answer row in some batch rows.", argument="query", value=query,
                            allowed="a non-empty query set")
    c = {n: view.cache[f"blocks.{l}.attn.{n}"] for n in names}
    return qk_from_activations(model, c["hook_rot_q"], c["hook_rot_k"], c["hook_v"], c["hook_pattern"], anchor, qm,
                               view.key_visible[l], rule, share)


def qk_from_activations(model: Any, rot_q: Tensor, rot_k: Tensor, v: Tensor, pattern: Tensor, anchor: Any,
                        query_mask: Tensor | None, key_visible: Tensor | None, rule: str = "top1",
                        share: float = 0.8) -> qk.QKDecomposition:
    """The tail of :func:`qk_at_layer` (arguments already checked) from one layer's ``hook_rot_q``,
    ``hook_rot_k``, ``hook_v`` and ``hook_pattern`` values, so the sweep can feed it from a shared forward."""
    causal = is_causal(model)
    if anchor is None or isinstance(anchor, str):
        anchor = _anchor_from_pattern(pattern, query_mask, key_visible, causal, anchor or rule)
    # a block-causal model's clean forward ran under its block mask: R_i holds only the keys query i could see
    # (DiffusionGemma's encoder/decoder visibility comes in key_visible from its sequence view instead)
    block = (model.cfg.extra.get("block_length") if getattr(model.cfg, "attention", None) == "block_causal"
             and not is_block_diffusion(model) else None)
    return qk.decompose(rot_q, rot_k, anchor, query_mask=query_mask, key_visible=key_visible, causal=causal, v=v,
                        share=share, block_length=block)


# ----------------------------------------------------------------------------------------------
# §3.8 regions of a zoo item and region flow
# ----------------------------------------------------------------------------------------------

from ._item_regions import _item_char_spans, regions_for_item  # noqa: E402,F401  (public here since the start)


@dataclass
class ItemFlows(ResultMixin):
    """Per-item region flows (regions differ between items, so no common region axis).

    ``gold_ratio`` / ``gold_ratio_density``: per item, answer-row flow to the gold doc over the mean to the
    other docs (raw / density-normalised); ``correct``: substring match of the generated answer.
    """

    results: list[F.FlowResult]
    gold_index: list[int | None]
    gold_ratio: Tensor              # [item]
    gold_ratio_density: Tensor      # [item]
    answers: list[str] = field(default_factory=list)
    correct: Tensor | None = None   # [item] substring match of the generated answer (zoo scoring)

    def to_frame(self, lead_dims=None, metrics=("answer_row", "answer_density", "answer_no_bos")) -> pd.DataFrame:
        """Long table: item, gold_index, region, kind, metric, value (answer-row metrics per region, plus
        the item-level gold_ratio / gold_ratio_density / row_spread / bos_share with region = None)."""
        rows = []
        for i, r in enumerate(self.results):
            for m in metrics:
                vals = to_numpy(getattr(r, m)).reshape(-1)
                rows += [dict(item=i, gold_index=self.gold_index[i], region=g.name, kind=g.kind, metric=m,
                              value=float(v)) for g, v in zip(r.regions, vals)]
            for m in ("gold_ratio", "gold_ratio_density", "row_spread", "bos_share"):
                rows.append(dict(item=i, gold_index=self.gold_index[i], region=None, kind=None, metric=m,
                                 value=float(to_numpy(getattr(r, m)).reshape(-1)[0])))
        return pd.DataFrame(rows)


@torch.no_grad()
def flow_for_items(model: Any, items: Sequence[Any], mode: Literal["default", "paper"] = "default",
                   gen_length: int | None = None, steps: int | None = None, residual: float = 0.5,
                   **generate_kwargs: Any) -> ItemFlows:
    """Region flow (§3.8) of each zoo item: generate the answer, one clean forward on the final sequence,
    head-mean attention per layer, regions from :func:`regions_for_item`, then ``flow.flow``.

    ``paper`` mode also rebuilds the boundaries the AF way (``flow.paper_region_shift``: off by one
    after BOS).  Diagnostics warnings are off; read ``row_spread`` / ``bos_absorbing`` on each result.
    Block-diffusion models: the answer rows are the decoder's, the prompt rows the encoder's (causal) own
    attention (:func:`final_attention`); generation maps ``gen_length`` / ``steps`` to DiffusionGemma's
    ``max_new_tokens`` / ``max_denoising_steps``.
    """
    from mdm_lens import items as D
    from mdm_lens import tokenization

    from ._text import encode_with_offsets, model_tokenizer

    C.own_generate_keywords(generate_kwargs, flow_for_items)
    items = _nonempty(items, "items", needs=("prompt",))
    mode = validate.choice(mode, ("default", "paper"), name="mode")
    residual = validate.number(residual, name="residual", min=0, max=1)
    g = _optional_length(gen_length, "gen_length") or int(model.cfg.extra.get("gen_length", 4))
    steps = _optional_length(steps, "steps")
    results, answers, correct = [], [], []
    tokenizer = model_tokenizer(model, "items", items[0], "a model with a tokenizer")
    for item in items:
        ids, offsets = encode_with_offsets(tokenizer, item.prompt)
        toks, _, _ = generate_final(model, [torch.tensor(ids)], g, steps, **generate_kwargs)
        pl = len(ids) if is_block_diffusion(model) else None  # only block-diffusion models split at the prompt
        attn = final_attention(model, toks, prompt_length=pl)[0].mean(1)       # [layer, T, T]
        # the answer as generated: DiffusionGemma fills whole canvases, so it can be longer than gen_length
        regs = regions_for_item(item, toks.shape[1] - len(ids), offsets)
        if mode == "paper":
            regs = F.paper_region_shift(regs)
        results.append(F.flow(attn, regs, causal=is_causal(model), mode=mode, residual=residual, warn=False))
        pad = model.cfg.pad_token_id  # dropped, as the zoo's decode did; masks and EOS stay visible
        answer = tokenization.decode(tokenizer, [t for t in toks[0, len(ids):].tolist() if t != pad])
        answers.append(answer)
        correct.append(D.substring_match(answer, item.answer))
    stack = lambda name: torch.stack([torch.as_tensor(getattr(r, name)).reshape(()) for r in results])  # noqa: E731
    return ItemFlows(results=results, gold_index=[it.gold_index for it in items], gold_ratio=stack("gold_ratio"),
                     gold_ratio_density=stack("gold_ratio_density"), answers=answers,
                     correct=torch.tensor(correct))
