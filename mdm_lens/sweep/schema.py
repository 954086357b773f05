"""The one description of the sweep's tables: every column (one dtype per column name across all tables, with
its meaning and unit), which tables hold it, and what each ``metric`` of a table means and is measured in.

From this one source: :func:`conform` (cast a table to the declared dtypes; an unknown column is an error),
:func:`write` (``schema.json`` and ``schema.md`` next to the tables, for the tables present) and
:func:`markdown` (the README's table, between ``<!-- sweep-schema:start -->`` / ``end`` markers, which
tests/test_report_claims.py compares with this module's output). Indices, positions, steps and counts are
nullable ``Int64`` everywhere, so a missing one is ``<NA>``, never a float or a sentinel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from mdm_lens.errors import ArgumentError, ArgumentTypeError

__all__ = ["Column", "COLUMNS", "TABLES", "METRICS", "SUMMARY_COLUMNS", "table_columns", "conform", "check",
           "as_dict", "markdown", "write", "README_START", "README_END"]

README_START, README_END = "<!-- sweep-schema:start -->", "<!-- sweep-schema:end -->"


@dataclass(frozen=True)
class Column:
    dtype: str          # "string", "float64", "Int64", "bool", "boolean" (nullable) or "list" (a vector per row)
    unit: str
    meaning: str


COLUMNS: dict[str, Column] = {
    "item_id": Column("string", "", "the item's id (input `id`, else its line number); rows are in data order"),
    "metric": Column("string", "", "what `value` (or `mean`/`std`) measures: see the metrics of each table"),
    "value": Column("float64", "see metric", "the measurement; NaN = undefined for this item (never 0 or 1)"),
    "condition": Column("string", "", "accuracy: with_context / no_context (gain in the summary); knockout: "
                                      "clean / anchors / random"),
    "layer": Column("Int64", "index", "transformer layer, 0 = first (`<NA>`: a whole-model row, e.g. cache "
                                       "log-probs; never -1, which would read as the last layer)"),
    "head": Column("Int64", "index", "attention head within the layer"),
    "step": Column("Int64", "index", "denoising step (recorded steps; `<NA>` = a per-item, not per-step, metric)"),
    "mode": Column("string", "", "absorption: `default` (the clean final sequence, lens rules) or `paper`"),
    "variant": Column("string", "", "absorption anchor rule: pos0 (column 0), top1 (top-1 received key), ...; "
                                    "`anchors` for the n_anchors count"),
    "gold_index": Column("Int64", "index", "position of the (first) gold passage in the prompt, 0 = first; "
                                           "`<NA>` when the data names no gold passage"),
    "gold_indices": Column("string", "indices", "every gold passage's position, comma-separated (several gold "
                                                "passages are all gold); empty when the data names none"),
    "n_passages": Column("Int64", "count", "passages in the prompt"),
    "prediction": Column("string", "", "the generated answer text (up to the first EOS/EoT/pad/mask)"),
    "region": Column("string", "", "flow: prompt region (bos, doc1.., question_cue, query, answer_cue, answer); "
                                   "summary: `gold doc` for every gold passage"),
    "kind": Column("string", "", "flow region kind: bos, doc, gold, template, query, answer, other"),
    "label": Column("string", "", "qk: the head's label from the decomposition (norm- / angle-driven, ...)"),
    "method": Column("string", "", "retrieval score: `copy@commit` (MDM) or `wu` (ARM, Wu et al.)"),
    "correct": Column("bool", "", "retrieval: the generated answer contains the gold (only these are scored)"),
    "key": Column("Int64", "position", "key position relative to the item's first real token"),
    "token": Column("Int64", "id", "token id at `key` in the final sequence"),
    "token_str": Column("string", "", "that token as text"),
    "received": Column("float64", "share", "head-mean attention the key receives from the non-pad queries"),
    "anchor": Column("bool", "", "the key is in the step's anchor set S_s"),
    "commit_step": Column("Int64", "index", "the step that committed the key (-1: never masked, a prompt token: kept "
                                                      "because it sorts before step 0, as in `trajectory.commit_step`)"),
    "prompt_length": Column("Int64", "count", "prompt tokens of the item (its generated canvas follows)"),
    # summaries
    "group": Column("string", "", "accuracy summary: overall or by_gold_position"),
    "mean": Column("float64", "see metric", "mean over items of the finite values"),
    "std": Column("float64", "see metric", "population std over items (ddof 0)"),
    "n": Column("Int64", "count", "items with a finite value in the group"),
    "n_excluded": Column("Int64", "count", "items of the group without a finite value (undefined, excluded)"),
    # lens / cache probes
    "answer_position": Column("Int64", "position", "lens: canvas position counted from the first generated token"),
    "answer": Column("boolean", "", "lens: the position lies before the first stop token (the answer's own tokens)"),
    "note": Column("string", "", "why `value` is NaN (empty otherwise)"),
    "kv_cache": Column("string", "", "cache: the approximate KV cache compared with fresh forwards (prefix / dual)"),
    "block": Column("Int64", "index", "cache: the denoising block of the step"),
    "reason": Column("string", "", "why `value` is NaN (empty otherwise); skipped: why the item was skipped"),
    "line": Column("Int64", "line", "the item's line in the data file (1 = first)"),
    "n_masked": Column("Int64", "count", "features: canvas positions still masked in the step's input"),
    "feature": Column("list", "activation", "features: `hook_resid_post` averaged over those positions (float32 "
                                            "list of d_model; NaN where none is masked)"),
    "acc": Column("float64", "0/1", "features: the item's answer contains a gold answer (the accuracy probe's)"),
    "em": Column("float64", "0/1", "features: the item's answer equals a gold answer (the accuracy probe's)"),
    "target_note": Column("string", "", "features: why a target is NA (e.g. no single gold passage)"),
    "component": Column("string", "", "atp: the patched activation (resid_pre, attn_out, mlp_out; z = per head)"),
    "exact": Column("float64", "nats", "atp: exact activation patching's effect of the same cell (NaN: not run, "
                                       "see reason)"),
}

_KEY = ["item_id"]
TABLES: dict[str, tuple[str, list[str]]] = {
    "accuracy": ("answer scores per item, with and without the passages",
                 _KEY + ["condition", "gold_index", "gold_indices", "n_passages", "metric", "value", "prediction"]),
    "absorption": ("share of attention the anchor set receives on the clean final sequence, per layer",
                   _KEY + ["layer", "mode", "variant", "metric", "value"]),
    "temporal": ("anchor sets over the denoising steps (per step) and their drift (step `<NA>`), per layer",
                 _KEY + ["layer", "step", "metric", "value"]),
    "temporal_keys": ("received attention per key and step, for the first --keep-keys items",
                      ["item_id", "layer", "step", "key", "token", "token_str", "received", "anchor", "commit_step",
                       "prompt_length"]),
    "qk": ("the top-1 key's QK logit advantage split into a key-norm and an angle term, per head",
           _KEY + ["layer", "head", "metric", "value", "label"]),
    "retrieval": ("retrieval (copy-paste) score per head; NaN for items not answered correctly",
                  _KEY + ["method", "layer", "head", "metric", "value", "correct"]),
    "flow": ("answer-row attention-rollout flow per prompt region, and per-item ratios (region `<NA>`)",
             _KEY + ["gold_index", "gold_indices", "region", "kind", "metric", "value"]),
    "knockout": ("answer log-prob etc. with the anchors or as many random keys knocked out",
                 _KEY + ["metric", "condition", "step", "value", "label", "note"]),
    "lens": ("logit lens over the denoising steps: per (step, layer) accuracies, per answer position emergence",
             _KEY + ["step", "layer", "answer_position", "answer", "metric", "value", "note"]),
    "features": ("pooled residual stream per (item, step, layer) with the item's targets, for linear probes",
                 _KEY + ["step", "layer", "n_masked", "feature", "note", "acc", "em", "gold_index", "gold_indices",
                         "target_note"]),
    "skipped": ("items left out by --skip-bad, with every reason (the manifest holds the same)",
                ["item_id", "line", "reason"]),
    "cache": ("what approximate KV caches change: per (step, layer) drift, per step log-probs, per item answer",
              _KEY + ["kv_cache", "step", "block", "layer", "metric", "value", "reason"]),
    "atp": ("attribution patching of the anchors' knockout per (step, component, layer, head), beside exact patching",
            _KEY + ["step", "component", "layer", "head", "metric", "value", "exact", "reason"]),
}
SUMMARY_COLUMNS = ["mean", "std", "n", "n_excluded"]

_POS = "position (tokens from the first real token)"
METRICS: dict[str, dict[str, tuple[str, str]]] = {
    "accuracy": {"acc": ("fraction", "normalised gold is a word-aligned substring of the answer (AF Acc)"),
                 "em": ("fraction", "normalised exact match"), "f1": ("fraction", "SQuAD token F1")},
    "absorption": {"absorption": ("%", "share of head-mean attention received by the anchor set"),
                   "null": ("%", "the same under uniform attention with the same visibility"),
                   "excess": ("points", "absorption − null"), "n_anchors": ("count", "anchors (variant `anchors`)")},
    "temporal": {"n_anchors": ("count", "|S_s|"), "top1_key": (_POS, "most-received key"),
                 "top1_mass": ("share", "attention the top-1 key receives"),
                 "anchor_mass": ("share", "attention the anchor set receives"),
                 "mean_jaccard": ("fraction", "probe's mean Jaccard of S_s, S_s+1 over the pairs not both empty (NaN if all are)"),
                 "drift_index": ("fraction", "1 − mean_jaccard"),
                 "n_distinct": ("count", "|∪_s S_s|"), "stability": ("fraction", "steps the modal anchor is in S_s (NaN: no anchor at any step)"),
                 "modal_anchor": (_POS, "the most persistent anchor (NaN: no anchor at any step)"),
                 "empty_fraction": ("fraction", "steps with S_s = ∅"),
                 "top1_change_rate": ("fraction", "step pairs whose top-1 key changes (NaN: one step, no pair)"),
                 "centroid_slope": ("positions / step", "OLS slope of the anchors' mass-weighted centroid (NaN: "
                                                        "fewer than two steps with anchors)"),
                 "mean_w1": ("positions", "mean Wasserstein-1 distance of consecutive received distributions (NaN: "
                                          "one step, no pair)"),
                 "jaccard_defined": ("fraction", "summary only: mean Jaccard over step pairs with at least one "
                                                 "anchor (NaN when every pair is empty)"),
                 "n_empty_pairs": ("count", "summary only: step pairs with both anchor sets empty (excluded)")},
    "qk": {"norm_term": ("logit", "N: key-norm part of the anchor's QK advantage"),
           "angle_term": ("logit", "G: angle part of the advantage"), "advantage": ("logit", "Δ = N + G"),
           "norm_share": ("fraction", "N / Δ (NaN where Δ ≤ 0)"), "angle_share": ("fraction", "G / Δ (NaN where Δ ≤ 0)"),
           "key_norm_ratio": ("ratio", "‖k*‖ / mean ‖k_j‖ of the other keys"),
           "cos_gap": ("cosine", "mean over queries of cos(q, k*) − mean cos(q, k_j)"),
           "anchor": (_POS, "the top-1 received key j*")},
    "retrieval": {"score": ("fraction", "copied needle tokens / needle length")},
    "flow": {"answer_row": ("share", "answer row of the region flow"),
             "answer_density": ("share / length share", "answer row over each region's share of the tokens"),
             "answer_no_bos": ("share", "answer row without BOS, renormalised"),
             "gold_ratio": ("ratio", "gold-doc flow / mean other-doc flow (all gold passages count as gold)"),
             "gold_ratio_density": ("ratio", "the same on the density-normalised row"),
             "row_spread": ("share", "max difference between two region rows (small: rank-one rollout)"),
             "bos_share": ("share", "mean rollout mass on BOS")},
    "knockout": {"value": ("nats", "the probe's headline metric per condition (answer_logprob)"),
                 "effect": ("nats", "value − value of clean: knockout − clean (< 0: the knockout lowers the gold "
                                    "answer's log-prob)"),
                 "answer_logprob": ("nats", "Σ over answer tokens of log p(gold) at the step that committed it"),
                 "answer_rank": ("rank", "mean rank of the gold tokens there among the tokens a sampler can commit "
                                 "(the mask id, never committed, is left out; 0 = argmax of those); "
                                 "`answer_logprob` is the full softmax's"),
                 "exact_match": ("fraction", "generated answer equals the gold"),
                 "tf_answer_logprob": ("nats", "teacher-forced gold log-prob at a step"),
                 "tf_answer_rank": ("rank", "teacher-forced gold rank at a step"),
                 "tf_answer_logprob_mean": ("nats", "mean of tf_answer_logprob over steps"),
                 "tf_answer_rank_mean": ("rank", "mean of tf_answer_rank over steps"),
                 "step_metric": ("logit", "per-step metric at the positions the clean run committed"),
                 "metric_mean": ("logit", "mean of step_metric"),
                 "n_targets": ("count", "keys knocked out per (row, layer) at a step"),
                 "agreement": ("fraction", "generated tokens equal to the clean generation"),
                 "accuracy": ("fraction", "substring match with the gold answer")},
    "lens": {"acc_masked": ("fraction", "still-masked positions whose lens top-1 is the final token"),
             "acc_all": ("fraction", "the same over all canvas positions"),
             "final_prob_masked": ("probability", "mean lens probability of the final token, masked positions"),
             "n_masked": ("count", "masked canvas positions in the step's input"),
             "emergence_step": ("index", "first step from which the layer's top-1 is the final token up to commit"),
             "commit_step": ("index", "the step that committed the position"),
             "lead": ("steps", "commit_step − emergence_step")},
    "cache": {"k_drift": ("ratio", "‖stale − fresh‖ / ‖fresh‖ of the cached keys"),
              "v_drift": ("ratio", "the same for the values"),
              "k_cosine": ("cosine", "mean cosine of stale and fresh keys"),
              "v_cosine": ("cosine", "the same for the values"),
              "received_tv": ("share", "total-variation distance of the received attention, cached vs fresh"),
              "anchor_jaccard": ("fraction", "Jaccard of the cached and fresh anchor sets (NaN: both empty)"),
              "logprob_fresh": ("nats", "log-prob of the final tokens at the window's masked positions, fresh"),
              "logprob_cached": ("nats", "the same, cached"), "logprob_delta": ("nats", "cached − fresh"),
              "answer_changed": ("fraction", "generated positions whose token differs from the uncached decode"),
              "forwards": ("count", "forwards of the cached run")},
    "atp": {"atp": ("nats", "AtP estimate (a_knockout − a_clean)·∂M/∂a on the clean step forward (noising), M = mean "
                            "log-prob of the tokens the clean run commits at the step; < 0: the knockout lowers M "
                            "through this component")},
}


def table_columns(name: str) -> list[str]:
    """The columns a table may hold: a long table's, or a ``{probe}_summary``'s (its group keys + mean/std/n)."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a table name, got {type(name).__name__}.", argument="name",
                                value=name, allowed=", ".join(TABLES))
    base = name[:-len("_summary")] if name.endswith("_summary") else name
    if base not in TABLES:
        raise ArgumentError(f"{name!r} is not a sweep table; known: {', '.join(TABLES)} (and their _summary).",
                            argument="name", value=name, allowed=", ".join(TABLES))
    cols = TABLES[base][1]
    if name.endswith("_summary"):
        keep = [c for c in cols if c not in ("item_id", "value", "prediction", "correct", "label", "token",
                                             "token_str", "received", "anchor", "note", "reason", "exact")]
        return (["group"] if base == "accuracy" else []) + keep + SUMMARY_COLUMNS
    return cols


def _cast(s: pd.Series, dtype: str) -> pd.Series:
    if dtype == "list":  # one vector per row (object column of float32 arrays): kept as it is
        return s
    if dtype == "string":
        return s if pd.api.types.is_string_dtype(s) and s.dtype != object else s.astype("str")
    if dtype == "Int64":
        return s.astype("Int64")
    if dtype == "bool":
        return s.astype(bool)
    if dtype == "boolean":
        return s.astype("boolean")
    return pd.to_numeric(s, errors="raise").astype("float64")


def conform(name: str, df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every column cast to its declared dtype (a copy); a column the schema does not know for
    ``name`` is an error, so a new column cannot reach the files undocumented."""
    allowed = table_columns(name)
    extra = [c for c in df.columns if c not in allowed]
    if extra:
        raise ArgumentError(f"table {name!r} has columns {extra} that mdm_lens/sweep/schema.py does not declare "
                            f"(declared: {', '.join(allowed)}).", argument="df", value=extra, allowed=str(allowed))
    out = df.copy()
    for c in out.columns:
        out[c] = _cast(out[c], COLUMNS[c].dtype)
    return out


def _dtype_ok(s: pd.Series, dtype: str) -> bool:
    if dtype == "list":
        return s.dtype == object
    if dtype == "string":
        return pd.api.types.is_string_dtype(s) and s.dtype != object or (s.dtype == object and s.isna().all())
    return str(s.dtype) == dtype


def check(tables: Mapping[str, pd.DataFrame]) -> list[str]:
    """Problems (unknown columns, other dtypes) of ``{name: table}`` against the schema; [] when none."""
    bad = []
    for name, df in tables.items():
        allowed = table_columns(name)
        for c in df.columns:
            if c not in allowed:
                bad.append(f"{name}.{c}: not declared")
            elif not _dtype_ok(df[c], COLUMNS[c].dtype):
                bad.append(f"{name}.{c}: {df[c].dtype}, declared {COLUMNS[c].dtype}")
    return bad


# those with a {name}_summary
SUMMARIZED = [t for t in TABLES if t not in ("temporal_keys", "lens", "cache", "features", "skipped")]


def as_dict(names: Any = None) -> dict[str, Any]:
    """The schema of the tables ``names`` (default: every long table and summary) as plain JSON-able data."""
    names = list(TABLES) + [f"{t}_summary" for t in SUMMARIZED] if names is None else list(names)
    out: dict[str, Any] = {"columns": {}, "tables": {}}
    for name in names:
        base = name[:-len("_summary")] if name.endswith("_summary") else name
        cols = table_columns(name)
        out["tables"][name] = {"meaning": TABLES[base][0] + (" (summary over items)" if base != name else ""),
                               "columns": cols, "metrics": {m: {"unit": u, "meaning": t}
                                                            for m, (u, t) in METRICS.get(base, {}).items()}}
        for c in cols:
            out["columns"][c] = {"dtype": COLUMNS[c].dtype, "unit": COLUMNS[c].unit, "meaning": COLUMNS[c].meaning}
    return out


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def markdown(names: Any = None) -> str:
    """Markdown tables: the columns (dtype, unit, meaning, which tables), then each table's metrics."""
    d = as_dict(names)
    where: dict[str, list[str]] = {}
    for t, info in d["tables"].items():
        for c in info["columns"]:
            where.setdefault(c, []).append(t)
    lines = ["| column | dtype | unit | meaning | tables |", "|---|---|---|---|---|"]
    for c, info in d["columns"].items():
        lines.append(f"| `{c}` | {info['dtype']} | {_cell(info['unit'])} | {_cell(info['meaning'])} | "
                     f"{', '.join(where[c])} |")
    lines += ["", "| table | metric | unit | meaning |", "|---|---|---|---|"]
    for t, info in d["tables"].items():
        for m, mi in (info["metrics"].items() if not t.endswith("_summary") or t[:-8] not in d["tables"] else ()):
            lines.append(f"| {t} | `{m}` | {_cell(mi['unit'])} | {_cell(mi['meaning'])} |")
    return "\n".join(lines) + "\n"


def write(root: str | Path, tables: Mapping[str, pd.DataFrame]) -> list[Path]:
    """``root/schema.json`` and ``root/schema.md`` for the tables written there (their names, in order)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = list(tables)
    paths = [root / "schema.json", root / "schema.md"]
    paths[0].write_text(json.dumps(as_dict(names), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths[1].write_text("# Sweep tables\n\n" + markdown(names), encoding="utf-8")
    return paths
