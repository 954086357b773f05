"""Report sections of a sweep that read per-head and per-region tables: retrieval heads, region flow, knockout.
Numbers and signs are those of the tables (``effect`` = knockout − clean, as in ``knockout.parquet``); each
comparison carries its 95% bootstrap interval over items and n (:mod:`mdm_lens.views.stats`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from mdm_lens.views import figures
from mdm_lens.views.report import Section
from mdm_lens.views.stats import Claims, bootstrap_mean, paired_difference, per_item

__all__ = ["retrieval_section", "flow_section", "knockout_section", "BUILTIN"]

THRESHOLD = 0.1                     # a retrieval head scores above this (Wu et al.)


# --- retrieval --------------------------------------------------------------------------------------

def _items_without_gold(s: Any) -> set[str]:
    """Items of sweep ``s`` that name no gold passage, from its accuracy (with context) or flow table."""
    for name in ("accuracy", "flow"):
        t = s.table(name)
        if t is not None and len(t) and "gold_index" in t:
            t = t[t.condition == "with_context"] if "condition" in t else t
            has = t.groupby("item_id")["gold_index"].apply(lambda g: g.notna().any())
            return set(has.index[~has.to_numpy(dtype=bool)])
    return set()


def retrieval_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("retrieval") is not None]     # a maker called directly
    if not sweeps:
        return None
    images, rows, claims, notes = [], [], Claims(), []
    per_model, methods = {}, {}
    for s in sweeps:
        t = s.table("retrieval")
        no_gold = _items_without_gold(s)
        if no_gold:     # no evidence span to copy from: a 0 there means "not scorable", not "scored zero"
            notes.append(f"{s.label}: {len(no_gold)} items name no gold passage, so nothing could be copied from "
                         "evidence; they are excluded (not scored)")
            t = t.assign(value=t["value"].where(~t.item_id.isin(no_gold)))
        counted = t.dropna(subset=["value"])
        n_items = int(counted.item_id.nunique())
        method = methods[s.label] = str(t.method.iloc[0])
        grid = t.groupby(["layer", "head"])["value"].mean().unstack("head")      # NaN where nothing counted
        above = int((grid > THRESHOLD).sum().sum())
        rows.append({"model": s.label, "method": method, "items counted (correct)": n_items,
                     "items": int(t.item_id.nunique()), "heads > 0.1": above, "heads": int(grid.size)})
        if not n_items:
            notes.append(f"{s.label}: no item was answered correctly, so no head was scored (no heatmap)")
            continue
        path = img / f"retrieval_{s.label}.png"
        figures.retrieval_heatmap(grid.to_numpy(dtype=float), path=path, threshold=THRESHOLD,
                                  title=f"{s.label}: retrieval score per head\n({method}, mean over {n_items} "
                                        "correctly answered items)")
        images.append(path)
        per_model[s.label] = per_item(counted)                              # per item: mean over heads
        layer, head = grid.stack().idxmax()
        best = per_item(counted[(counted.layer == layer) & (counted["head"] == head)])
        claims.estimate(f"{s.label}: mean score over heads", bootstrap_mean(per_model[s.label]),
                        f"{s.label}'s mean score over heads is")
        claims.estimate(f"{s.label}: score of its best head, L{layer}.H{head}", bootstrap_mean(best),
                        f"its best head, L{layer}.H{head} (picked as the largest mean, so optimistic), scores")
    if len({methods[m] for m in per_model}) == 1:
        claims.rank(per_model, "mean head score", "{a}'s heads copy more than {b}'s", "{a}'s and {b}'s heads copy alike")
    elif len(per_model) > 1:
        notes.append("the models are scored by different methods (" + ", ".join(f"{m}: {methods[m]}" for m in
                                                                                 per_model) + "), so their scores "
                     "are not compared")
    text = ("Wu et al.'s copy-paste score adapted to diffusion: at the step that committed each answer token, a head "
            "copies when its argmax key lies in the gold evidence and holds the emitted token (query p−1 for an "
            "ARM). Score = copied needle tokens / needle length, over correctly answered items (grey cells: not "
            "scored); retrieval head > 0.1. " + ". ".join(n[0].upper() + n[1:] for n in notes) + ("." if notes else ""))
    return Section("Retrieval heads", text, images, table=pd.DataFrame(rows).set_index("model"), claims=claims.table(),
                   finding=claims.finding())


# --- flow -------------------------------------------------------------------------------------------

_ORDER = ("bos", "gold doc", "other docs (mean)", "question_cue", "query", "answer_cue", "answer")


def _flow_per_item(t: pd.DataFrame) -> pd.DataFrame:
    """[item, region] density-normalised answer flow: every gold passage pooled into "gold doc" and the
    other passages into "other docs (mean)", each averaged within the item; with the item's passage count
    and gold index."""
    d = t[(t.metric == "answer_density") & t.region.notna()].copy()
    d["pooled"] = d["region"].where(~d.kind.isin(["gold", "doc"]),
                                    d.kind.map({"gold": "gold doc", "doc": "other docs (mean)"}))
    wide = d.groupby(["item_id", "pooled"], sort=False)["value"].mean().unstack("pooled")
    info = d.groupby("item_id", sort=False).agg(n_passages=("kind", lambda k: int(k.isin(["gold", "doc"]).sum())),
                                                gold_index=("gold_index", "first"))
    return wide.join(info)


def flow_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("flow") is not None]     # a maker called directly
    if not sweeps:
        return None
    images, rows, claims, ratios = [], [], Claims(), {}
    notes = []
    for s in sweeps:
        t = s.table("flow")
        item = t[t.region.isna()].pivot_table(index="item_id", columns="metric", values="value", dropna=False)
        ratio = ratios[s.label] = item["gold_ratio_density"] if "gold_ratio_density" in item else pd.Series(dtype=float)
        iv = bootstrap_mean(ratio - 1.0)
        rows.append({"model": s.label, "items": len(item), "items with a gold ratio": iv.n,
                     "gold ratio (density)": ratio.mean(), "row spread": item["row_spread"].mean(),
                     "BOS share": item["bos_share"].mean()})
        claims.add(f"{s.label}: gold ratio (density) − 1", iv,  # Δ = ratio − 1: a claim needs it off 0
                   f"{s.label} sends the gold passage(s) more density-normalised answer flow than the mean other "
                   "passage", f"{s.label} sends the gold passage(s) less flow than the mean other passage",
                   f"{s.label} sends the gold passage(s) as much flow as the mean other passage")
        per = _flow_per_item(t)
        gold = per[per.gold_index.notna() & per.get("gold doc", pd.Series(np.nan, index=per.index)).notna()]
        if not len(gold):
            notes.append(f"{s.label}: no item names a gold passage, so no flow-by-gold-position figure")
            continue
        k = int(gold.n_passages.value_counts().idxmax())
        g = gold[gold.n_passages == k]
        order = [c for c in _ORDER if c in g.columns]
        table = g.groupby("gold_index")[order].mean().sort_index()
        counts = g.groupby("gold_index").size()
        flows = {f"gold doc {int(i) + 1} ({counts[i]} items)": table.loc[i].to_numpy() for i in table.index}
        path = img / f"flow_{s.label}.png"
        figures.region_flow(flows, order, {n: order.index("gold doc") for n in flows}, path=path,
                            value_label="answer-row share / (region size / T)",
                            title=f"{s.label}: answer-row flow by gold position\n(default mode: token rollout, "
                                  f"density-normalised; {k} passages, {len(g)} of {len(per)} items)")
        images.append(path)
    claims.rank(ratios, "gold ratio (density)", "{a} prefers the gold passage more than {b}",
                "{a} and {b} prefer the gold passage alike")
    text = ("Token-level attention rollout (residual 0.5, all layers) pooled to regions from one tokenisation; the "
            "answer row, divided by each region's length share to remove the length bias. Gold ratio = flow to the "
            "gold passage(s) / mean flow to the other passages (every gold passage counts as gold; 1 = no "
            "preference), over the items that have a gold passage and another one (the others are excluded and "
            "counted). The figure takes each model's most common passage count. " + ". ".join(notes)
            + ("." if notes else ""))
    return Section("Region-level attention flow", text, images, table=pd.DataFrame(rows).set_index("model").round(3),
                   claims=claims.table(), finding=claims.finding())


# --- knockout ---------------------------------------------------------------------------------------

def _effects(t: pd.DataFrame) -> pd.DataFrame:
    """[item, condition] ``effect`` = knockout − clean (answer log-prob, nats), as ``knockout.parquet`` has it;
    from ``answer_logprob`` when a table has no effect rows."""
    e = t[t.metric == "effect"]
    if len(e):
        return e.pivot_table(index="item_id", columns="condition", values="value", dropna=False)
    lp = t[t.metric == "answer_logprob"].pivot_table(index="item_id", columns="condition", values="value")
    return lp.sub(lp["clean"], axis=0)


def knockout_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("knockout") is not None]     # a maker called directly
    if not sweeps:
        return None
    labels, bars, rows, empty = [], {"anchors": [], "random": []}, [], []
    claims = Claims()
    for s in sweeps:
        t = s.table("knockout")
        eff = _effects(t)
        ea = eff.get("anchors", pd.Series(np.nan, index=eff.index))
        er = eff.get("random", pd.Series(np.nan, index=eff.index))
        ia, ir = bootstrap_mean(ea), bootstrap_mean(er)
        labels.append(s.label)
        for cond, iv in (("anchors", ia), ("random", ir)):
            bars[cond].append((iv.estimate, iv.estimate - iv.low if np.isfinite(iv.low) else 0.0,
                               iv.high - iv.estimate if np.isfinite(iv.high) else 0.0))
        claims.add(f"{s.label}: effect of the anchor knockout", ia,
                   f"knocking out {s.label}'s anchors raises the gold answer's log-prob",
                   f"knocking out {s.label}'s anchors lowers the gold answer's log-prob",
                   f"knocking out {s.label}'s anchors leaves the gold answer's log-prob unchanged", unit="nats")
        claims.add(f"{s.label}: effect anchors − effect random", paired_difference(ea, er),
                   f"{s.label}'s anchor knockout leaves the gold answer's log-prob higher than a random-key "
                   "knockout does", f"{s.label}'s anchor knockout leaves the gold answer's log-prob lower than a "
                   "random-key knockout does", f"{s.label}'s anchor and random-key knockouts leave it alike",
                   unit="nats")
        cond = {m: t[t.metric == m].groupby("condition")["value"].mean()
                for m in ("answer_logprob", "tf_answer_logprob_mean", "answer_rank", "exact_match", "agreement",
                          "n_targets")}
        for c in eff.columns:
            rows.append({"model": s.label, "condition": c, "effect (knockout − clean, nats)": eff[c].mean(),
                         "answer log-prob": cond["answer_logprob"].get(c, np.nan),
                         "teacher-forced answer log-prob": cond["tf_answer_logprob_mean"].get(c, np.nan),
                         "gold rank": cond["answer_rank"].get(c, np.nan),
                         "exact match": cond["exact_match"].get(c, np.nan),
                         "agreement with clean": cond["agreement"].get(c, np.nan),
                         "keys knocked per row": cond["n_targets"].get(c, np.nan), "items": int(eff[c].notna().sum())})
        if float(cond["n_targets"].get("anchors", 0.0)) == 0.0:
            empty.append(s.label)
    a, r = np.asarray(bars["anchors"]).T, np.asarray(bars["random"]).T     # [mean, below, above] x model
    path = img / "knockout.png"
    figures.knockout_effect(labels, a[0], r[0], a[1:], r[1:], path=path, xlabel="model", show_values=True,
                            ylabel="effect = knockout − clean, nats\n(< 0: lowers the gold answer)",
                            title="Anchor vs random-key knockout (mean, 95% CI over items)")
    text = ("At every step and layer the scores from the still-masked (readout) queries to the detected anchors are "
            "set to −∞; the control removes as many random visible keys. Effect = knockout − clean log-probability "
            "of the gold answer (the `effect` column of knockout.parquet), summed over its tokens, each read at "
            "the step that committed it in the knocked-out run: < 0 means the knockout lowers the gold answer. "
            "The table adds the teacher-forced log-prob (gold placed in the clean run's canvases), the gold tokens' "
            "mean rank (0 = argmax), exact match of the generated answer, and the share of generated tokens "
            "unchanged from the clean run.")
    if empty:
        text += (f" Bars at 0 for {', '.join(empty)}: the detector found no anchors there, so nothing was knocked "
                 "out and the random control removed nothing either.")
    return Section("Anchor knockout vs random control", text, [path], table=pd.DataFrame(rows).set_index("model").round(3),
                   claims=claims.table(), finding=claims.finding())


BUILTIN = [dict(key="retrieval", make=retrieval_section, tables=("retrieval",)),
           dict(key="flow", make=flow_section, tables=("flow",)),
           dict(key="knockout", make=knockout_section, tables=("knockout",))]
