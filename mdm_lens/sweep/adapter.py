"""The one place where the sweep calls the probes (``mdm_lens.probes.*``) and turns their results into
tidy rows keyed by ``item_id``.

Every function takes the model, a batch (``Batch``: left-padded prompts of rendered items) and the
sweep settings, and returns one long DataFrame: ``item_id`` first, then the probe's own axes
(``layer`` / ``head`` / ``step`` / ``variant`` / ``condition`` ...), ``metric`` and ``value``. Positions
are reported relative to the item's first real token, so a row does not depend on its batch's padding.

Batched: accuracy, absorption, temporal, qk, flow. A batch is cut into runs of equal prompt length
(``Settings.exact``, ``--batching length``) or run whole, left-padded (``padded``). Per run: one sampler call
(shared by all of them) and two clean forwards of the final sequences: ``final_attention`` (per layer
group, :func:`attention_tables`) serves absorption in both modes and flow, and one SDPA forward
(:func:`shared.qk_all_layers`) serves qk at every layer, each bit-identical to the probe's own forward. The
table rows are built as numpy columns, one DataFrame per run and table. The closed-book runs of
``accuracy`` group the whole batch by closed-book prompt length. Per item (the probes generate each item
alone): retrieval, knockout.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mdm_lens.diffusion.fixed_length import require_fixed_length
from mdm_lens import ReceivedAttention, tokenization
from mdm_lens.errors import MemoryBudgetError
from mdm_lens.probes import flow as F
from mdm_lens.probes import patching, retrieval
from mdm_lens.probes import run as R
from mdm_lens.sweep import atp_tables, cache_tables, feature_tables, lens_tables, shared as SH
from mdm_lens.sweep.batch import Batch, Settings  # noqa: F401  (re-exported: adapter.Batch / adapter.Settings)
from mdm_lens.sweep.lengths import _gen_kwargs, sweep_block_length  # noqa: F401  (adapter._gen_kwargs for the runner)
from mdm_lens.sweep.tables import (DRIFT_METRICS, KEY_COLUMNS, PATTERN_BUDGET_BYTES, STEP_METRICS,  # noqa: F401
                                   _anchor_mass, frame, temporal)
from mdm_lens.sweep.templates import Rendered
from mdm_lens import items as D
from mdm_lens.items import char_span_to_token_span

__all__ = ["PROBES", "NEEDS_QA", "Batch", "Settings", "make_batch", "sub_batches", "compute", "preflight"]

PROBES = ("accuracy", "absorption", "temporal", "qk", "retrieval", "flow", "knockout", "lens", "cache", "features",
          "atp")
NEEDS_QA = {"accuracy": "answers", "retrieval": "a question with passages and answers",
            "flow": "a question with passages"}


def _pad(model: Any, rows: list[list[int]]) -> tuple[Tensor, Tensor, list[int]]:
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], am[i, width - len(r):] = torch.tensor(r, dtype=torch.long), 1
    dev = model.input_device
    return ids.to(dev), am.to(dev), [width - len(r) for r in rows]


def make_batch(model: Any, rendered: list[Rendered], nocontext: list[Rendered] | None, seeds: list[int],
               order: list[int]) -> Batch:
    ids, am, off = _pad(model, [r.ids for r in rendered])
    return Batch(rendered, nocontext, ids, am, off, [r.item.id for r in rendered], seeds, order)


def sub_batches(model: Any, batch: Batch, exact: bool) -> list[Batch]:
    """The runs of a batch: its equal-length groups (first-seen length first) when ``exact``, else itself."""
    if not exact:
        return [batch]
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(batch.rendered):
        groups.setdefault(len(r.ids), []).append(i)
    if len(groups) == 1:
        return [batch]
    pick = lambda xs, idx: None if xs is None else [xs[i] for i in idx]  # noqa: E731
    return [make_batch(model, pick(batch.rendered, g), pick(batch.nocontext, g), pick(batch.seeds, g),
                       pick(batch.order, g)) for g in groups.values()]


@contextmanager
def run_block_mask(model: Any, block_length: int | None) -> Iterator[None]:
    """A block-causal model's plain forwards (``final_attention``, ``qk``, ``flow``, …) take the family default
    ``cfg.extra["block_length"]``; a sweep run with ``--block-length`` decodes under another mask, so for the
    sweep's duration that default is the sweep's, and every clean forward sees the mask the sampler used
    (restored afterwards, also when the sweep raises). Models without a block mask are left alone."""
    default = model.cfg.extra.get("block_length")
    if default is None or block_length is None or block_length == default:
        yield
        return
    model.cfg.extra["block_length"] = block_length
    try:
        yield
    finally:
        model.cfg.extra["block_length"] = default


def generate(model: Any, ids: Tensor, am: Tensor, s: Settings, seed: int, record: list | None = None,
             cache: Any = None) -> Any:
    """The batch's shared sampler run (the model's default sampler, always fixed-length today; checked, because
    every table reads its columns as positions shared by all steps). ``cache``: what the run records for the lens
    on samplers it cannot replay (``lens_tables.run_cache``)."""
    extra = {} if cache is None else {"cache": cache}
    out = model.generate(ids, attention_mask=am, seed=seed, record=record or [], **_gen_kwargs(model, s), **extra)
    require_fixed_length(out, "the sweep", "its tables key every step's values by canvas position, and a row "
                         "inserted or deleted mid-run has no position shared by all steps")
    return out


def _strip(model: Any, out: Any, b: int, offset: int) -> tuple[Tensor, Tensor]:
    """Row b of a left-padded run without its pads: (tokens, attention mask)."""
    return out.tokens[b, offset:], out.attention_mask[b, offset:]


def _answer_text(model: Any, ids: list[int]) -> str:
    """Generated ids up to the first EOS / EoT / pad / mask, decoded without special tokens."""
    stop = {model.cfg.eos_token_id, model.cfg.pad_token_id, model.cfg.mask_token_id,
            model.cfg.extra.get("special_tokens", {}).get("<|eot_id|>")} - {None}
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return tokenization.decode(model.tokenizer, ids[:cut], skip_special_tokens=True).strip()


# --- accuracy ---------------------------------------------------------------------------------------

def _accuracy_rows(model: Any, batch: Batch, rendered: list[Rendered], generated: list[list[int]],
                   condition: str) -> list[dict]:
    rows = []
    for b, (r, gen) in enumerate(zip(rendered, generated)):
        pred = _answer_text(model, gen)
        golds = r.item.answers
        acc = max(float(retrieval.answer_correct(model, gen, a)) for a in golds)   # AF Acc: normalised substring
        em = max(D.exact_match(pred, a) for a in golds)
        f1 = max(D.token_f1(pred, a) for a in golds)
        for metric, v in (("acc", acc), ("em", em), ("f1", f1)):
            rows.append(dict(item_id=batch.item_ids[b], condition=condition, gold_index=r.item.gold_index,
                             n_passages=len(r.item.passages), metric=metric, value=v, prediction=pred))
    return rows


def _generated(out: Any) -> list[list[int]]:
    return out.tokens[:, out.prompt_length:].tolist()


def _generate_rows(model: Any, rendered: list[Rendered], s: Settings, seed: int) -> list[list[int]]:
    """Generated ids per row; with ``s.exact`` one sampler call per prompt length (no padding)."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rendered):
        groups.setdefault(len(r.ids) if s.exact else 0, []).append(i)
    gen: list[list[int]] = [[] for _ in rendered]
    for idx in groups.values():
        ids, am, _ = _pad(model, [rendered[i].ids for i in idx])
        for i, g in zip(idx, _generated(generate(model, ids, am, s, seed))):
            gen[i] = g
    return gen


def accuracy(model: Any, batch: Batch, s: Settings, shared: dict) -> pd.DataFrame:
    """With-context rows of one run (its shared sampler output)."""
    return pd.DataFrame(_accuracy_rows(model, batch, batch.rendered, _generated(shared["out"]), "with_context"))


def accuracy_closed_book(model: Any, batch: Batch, s: Settings) -> pd.DataFrame:
    """No-context rows of a whole batch: one sampler call per closed-book prompt length (``exact``) or one."""
    closed = _generate_rows(model, batch.nocontext, s, batch.seeds[0])
    return pd.DataFrame(_accuracy_rows(model, batch, batch.nocontext, closed, "no_context"))


# --- absorption -------------------------------------------------------------------------------------

def _layer_groups(model: Any, batch: Batch, T: int) -> list[list[int]]:
    per_layer = len(batch.item_ids) * model.cfg.n_heads * T * T * 8
    k = max(1, int(PATTERN_BUDGET_BYTES // max(per_layer, 1)))
    L = list(range(model.cfg.n_layers))
    return [L[i:i + k] for i in range(0, len(L), k)]


def attention_tables(model: Any, batch: Batch, s: Settings, shared: dict, names: list[str]) -> dict[str, pd.DataFrame]:
    """``absorption`` (both modes) and ``flow`` from ONE ``final_attention`` forward per layer group (each
    probe ran that same forward before); a group's patterns are dropped before the next group's forward."""
    out = shared["out"]
    parts: list[dict] = []
    T = out.tokens.shape[1]
    if R.patterns_exceed_budget(model, (len(batch.item_ids), T), 1):   # one layer's patterns do not fit
        return _long_context_tables(model, batch, out, names)
    attn = [None] * len(batch.item_ids)                                    # flow: head-mean [layer, T, T] per item
    for group in _layer_groups(model, batch, T):
        full = R.final_attention(model, out.tokens, out.attention_mask, layers=group)
        if "absorption" in names:
            parts += _absorption_parts(model, batch, out, group, full)
        if "flow" in names:
            a = full.mean(2)                                               # [b, l, T, T]
            for b, off in enumerate(batch.offsets):
                part = a[b, :, off:, off:]
                attn[b] = part if attn[b] is None else torch.cat([attn[b], part])
        del full
    tables = {}
    if "absorption" in names:
        tables["absorption"] = frame(parts, sort_by=["item_id", "mode", "layer", "variant", "metric"])
    if "flow" in names:
        tables["flow"] = flow(model, batch, s, attn)
    return tables


def _long_context_tables(model: Any, batch: Batch, out: Any, names: list[str]) -> dict[str, pd.DataFrame]:
    """Absorption when even one layer's patterns exceed the budget: the received mass over query chunks (one
    forward, O(T·chunk) memory, = the pattern path to float64 rounding). Flow reads whole patterns: refused."""
    if "flow" in names:
        raise MemoryBudgetError(f"flow needs each layer's [batch, head, T, T] pattern ({len(batch.item_ids)} x "
                                f"{model.cfg.n_heads} x {out.tokens.shape[1]}^2 float64 > "
                                f"{R.PATTERN_BUDGET_BYTES // 2 ** 20} MiB); sweep flow with --batch-size 1 or "
                                "shorter inputs, and absorption (query-chunked) separately.")
    from mdm_lens.hooks.reducers import received_by_layer

    layers = list(range(model.cfg.n_layers))
    received = received_by_layer(model, out.tokens, out.attention_mask, layers=layers)
    return {"absorption": frame(_absorption_parts(model, batch, out, layers, received=received),
                                sort_by=["item_id", "mode", "layer", "variant", "metric"])}


def _absorption_parts(model: Any, batch: Batch, out: Any, group: list[int], attn: Tensor | None = None,
                      received: Tensor | None = None) -> list[dict]:
    """Absorption rows of one layer group, both modes, from that group's ``final_attention`` (or, at long
    contexts, its query-chunked received mass)."""
    ids = np.asarray(batch.item_ids, object)
    parts = []
    for mode in ("default", "paper"):
        # = R.absorption_by_layer(model, out.tokens, attention_mask=out.attention_mask, mode=mode, layers=group)
        if received is not None:
            am = None if out.attention_mask is None else out.attention_mask.bool()
            res = R.absorption_chunked(model, out.tokens, am, mode, "zscore", "mean", group, received=received)
        else:
            res = R.absorption_from_attention(model, attn, out.tokens, out.attention_mask, mode, "zscore", "mean",
                                              group)
        for metric, t in (("absorption", res.per_sample), ("null", res.null), ("excess", res.excess)):
            a = t.cpu().numpy()                          # [batch, layer, variant]
            bi, li, vi = np.indices(a.shape).reshape(3, -1)
            parts.append(dict(item_id=ids[bi], layer=np.asarray(res.layers)[li], mode=mode,
                              variant=np.asarray(res.variants, object)[vi], metric=metric,
                              value=a.reshape(-1).astype(float)))
        n = res.n_anchors.cpu().numpy()
        bi, li = np.indices(n.shape).reshape(2, -1)
        parts.append(dict(item_id=ids[bi], layer=np.asarray(res.layers)[li], mode=mode, variant="anchors",
                          metric="n_anchors", value=n.reshape(-1).astype(float)))
    return parts


# --- qk ---------------------------------------------------------------------------------------------

QK_METRICS = ("norm_term", "angle_term", "advantage", "norm_share", "angle_share", "key_norm_ratio", "cos_gap",
              "anchor")


def qk(model: Any, batch: Batch, s: Settings, shared: dict) -> pd.DataFrame:
    out = shared["out"]
    ids = np.asarray(batch.item_ids, object)
    parts = []
    # = [R.qk_at_layer(model, out.tokens, layer, attention_mask=out.attention_mask) for layer in layers]
    for layer, dec in enumerate(SH.qk_all_layers(model, out.tokens, out.attention_mask)):
        labels = np.asarray(dec.labels, dtype=object)                    # [batch, head]
        for m in QK_METRICS:
            a = dec.__dict__[m].cpu().numpy().astype(float)
            if m == "anchor":
                a = a - np.asarray(batch.offsets, float)[:, None]
            bi, hi = np.indices(a.shape).reshape(2, -1)
            parts.append(dict(item_id=ids[bi], layer=layer, head=hi, metric=m, value=a.reshape(-1),
                              label=labels[bi, hi]))
    return frame(parts)


# --- flow -------------------------------------------------------------------------------------------

FLOW_ITEM_METRICS = ("gold_ratio", "gold_ratio_density", "row_spread", "bos_share")


def flow(model: Any, batch: Batch, s: Settings, attn: list[Tensor]) -> pd.DataFrame:
    """Region flow (§3.8) per item, as ``probes.run.flow_for_items`` does it, from each item's head-mean final
    attention ``attn[b]`` ``[layer, T, T]`` (its pads cut)."""
    rows = []
    causal = R.is_causal(model)
    for b, r in enumerate(batch.rendered):
        regs = R.regions_for_item(r.qa, s.gen_length, r.offsets)
        res = F.flow(attn[b], regs, causal=causal, mode="default", residual=0.5, warn=False)
        names = np.asarray([g.name for g in res.regions], object)
        kinds = np.asarray([g.kind for g in res.regions], object)
        for m in ("answer_row", "answer_density", "answer_no_bos"):
            vals = torch.as_tensor(res.__dict__[m]).reshape(-1).double().cpu().numpy()
            n = min(len(vals), len(names))
            rows.append(dict(item_id=batch.item_ids[b], gold_index=r.qa.gold_index, region=names[:n], kind=kinds[:n],
                             metric=m, value=vals[:n]))
        item_vals = [float(torch.as_tensor(res.__dict__[m]).reshape(-1)[0]) for m in FLOW_ITEM_METRICS]
        rows.append(dict(item_id=batch.item_ids[b], gold_index=r.qa.gold_index, region=None, kind=None,
                         metric=np.asarray(FLOW_ITEM_METRICS, object), value=np.asarray(item_vals, float)))
    df = frame(rows)
    df["gold_index"] = df["gold_index"].astype("Int64")
    return df


# --- retrieval --------------------------------------------------------------------------------------

def retrieval_item(r: Rendered) -> retrieval.RetrievalItem:
    """The needle (answer occurrence in the gold passage) and gold doc as token spans of ``r``'s tokenisation."""
    qa = r.qa
    ev = [] if qa.evidence_span is None else [char_span_to_token_span(r.offsets, qa.evidence_span)]
    gold = None
    if qa.gold_index is not None:
        s0, e0 = qa.passage_spans[qa.gold_index]
        if qa.marker_spans:
            s0 = qa.marker_spans[qa.gold_index][0]
        gold = char_span_to_token_span(r.offsets, (s0, e0))
    return retrieval.RetrievalItem(torch.tensor(r.ids, dtype=torch.long), ev, qa.answer, gold)


def retrieval_method(model: Any) -> str:
    return "wu" if R.is_causal(model) else "copy@commit"


def retrieval_rows(model: Any, batch: Batch, s: Settings, shared: dict) -> pd.DataFrame:
    method = retrieval_method(model)
    kw = _gen_kwargs(model, s)
    kw.pop("progress")
    frames = []
    for b, r in enumerate(batch.rendered):
        res = retrieval.retrieval_scores(model, [retrieval_item(r)], method=method, seed=batch.seeds[b], **kw)
        a = res.per_sample[0].cpu().numpy()                            # [layer, head], NaN when not counted
        li, hi = np.indices(a.shape).reshape(2, -1)
        frames.append(pd.DataFrame(dict(item_id=batch.item_ids[b], method=method, layer=np.asarray(res.layers)[li],
                                        head=hi, metric="score", value=a.reshape(-1).astype(float),
                                        correct=bool(res.correct[0]))))
    return pd.concat(frames, ignore_index=True)


# --- knockout ---------------------------------------------------------------------------------------

def knockout(model: Any, batch: Batch, s: Settings, shared: dict) -> pd.DataFrame:
    kw = _gen_kwargs(model, s)
    kw.pop("progress")
    refused = _knockout_refusal(model)
    if refused is not None:  # NaN effects per item, the reason in `note` (as lens / cache record theirs)
        ids = [i for i in batch.item_ids for _ in range(2)]
        return pd.DataFrame({"item_id": ids, "metric": "effect", "condition": ["anchors", "random"] * len(batch.item_ids),
                             "step": pd.array([pd.NA] * len(ids), dtype="Int64"), "value": np.nan, "note": refused})
    kw["n_steps"] = kw.pop("steps")  # a sampler without steps was refused above
    frames = []
    for b, r in enumerate(batch.rendered):
        answer = r.item.answers[0] if r.item.answers else None
        res = patching.knockout(model, torch.tensor(r.ids), answer=answer, n_random=s.n_random, seed=batch.seeds[b],
                                **kw)
        df = res.to_frame()
        df.insert(0, "item_id", batch.item_ids[b])  # to_frame's `note` says why a value is NaN or not comparable
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    return out.drop(columns=[c for c in ("label",) if c in out and out[c].isna().all()])


def _knockout_refusal(model: Any) -> str | None:
    """Why knockout refuses this model's default sampler (one without a steps setting), else None."""
    from mdm_lens.errors import SamplerConfigError
    from mdm_lens.probes.knockout import _check_sampler

    try:
        _check_sampler(model, {})
    except SamplerConfigError as e:
        return str(e)
    return None


def atp(model: Any, batch: Batch, s: Settings, shared: dict) -> pd.DataFrame:
    kw = _gen_kwargs(model, s)
    kw.pop("progress")
    return atp_tables.atp(model, batch, s, shared, kw)


# --- dispatch ---------------------------------------------------------------------------------------

_BATCHED: dict[str, Callable] = {"accuracy": accuracy, "qk": qk, "lens": lens_tables.lens,
                                 "cache": cache_tables.cache,
                                 "features": partial(feature_tables.features, score=_accuracy_rows)}
_ATTENTION = ("absorption", "flow")
_PER_ITEM: dict[str, Callable] = {"retrieval": retrieval_rows, "knockout": knockout, "atp": atp}


def preflight(model: Any, n_items: int, probes: list[str], s: Settings) -> None:
    """Refusals that need only the sizes, before any model call: the ``features`` table's memory budget."""
    if "features" in probes:
        feature_tables.check_budget(model, n_items, 1 if R.is_causal(model) else s.steps)


def _run_tables(model: Any, run: Batch, probes: list[str], s: Settings) -> dict[str, pd.DataFrame]:
    """The batched probes on one run: one sampler call and the shared clean forwards."""
    record = [ReceivedAttention()] if "temporal" in probes else None
    cache = lens_tables.run_cache(model) if "lens" in probes else None
    shared: dict[str, Any] = {"out": generate(model, run.ids, run.attention_mask, s, run.seeds[0], record, cache)}
    tables: dict[str, pd.DataFrame] = {}
    if any(p in _ATTENTION for p in probes):
        tables.update(attention_tables(model, run, s, shared, probes))
    for p in probes:
        if p == "temporal":
            tables.update(temporal(model, run, s, shared, [o < s.keep_keys for o in run.order]))
        elif p in _BATCHED:
            tables[p] = _BATCHED[p](model, run, s, shared)
    return tables


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    full = [f for f in frames if len(f)]
    return frames[0] if not full else full[0] if len(full) == 1 else pd.concat(full, ignore_index=True)


@torch.no_grad()
def compute(model: Any, batch: Batch, probes: list[str], s: Settings, closed_book: bool = True
            ) -> dict[str, pd.DataFrame]:
    """All requested probes on one batch → {table name: rows}, each item's rows in the order the probe gives.
    ``closed_book=False``: accuracy's no-context rows are left to a closed-book unit (:func:`accuracy_closed_book`)."""
    parts: dict[str, list[pd.DataFrame]] = {}
    if any(p in _BATCHED or p in _ATTENTION or p == "temporal" for p in probes):
        for run in sub_batches(model, batch, s.exact):
            for name, df in _run_tables(model, run, probes, s).items():
                parts.setdefault(name, []).append(df)
    if "accuracy" in probes and closed_book:
        parts["accuracy"].append(accuracy_closed_book(model, batch, s))
    for p in probes:
        if p in _PER_ITEM:
            parts[p] = [_PER_ITEM[p](model, batch, s, {})]
    return {name: _concat(frames) for name, frames in parts.items()}
