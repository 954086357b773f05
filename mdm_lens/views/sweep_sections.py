"""Report sections of a sweep that read per-head and per-region tables: retrieval heads, region flow, knockout."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from mdm_lens.views import figures
from mdm_lens.views.report import Section

__all__ = ["retrieval_section", "flow_section", "knockout_section"]


def retrieval_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("retrieval") is not None]
    if not have:
        return None
    images, rows, finds = [], [], []
    for s in have:
        t = s.table("retrieval")
        counted = t.dropna(subset=["value"])
        n_items = int(counted.item_id.nunique())
        method = str(t.method.iloc[0])
        grid = t.groupby(["layer", "head"])["value"].mean().unstack("head")      # NaN where nothing counted
        path = img / f"retrieval_{s.label}.png"
        figures.retrieval_heatmap(np.nan_to_num(grid.to_numpy()), path=path,
                                  title=f"{s.label} retrieval score per head ({method}, {n_items} correct items)")
        images.append(path)
        above = int((grid > 0.1).sum().sum())
        total = grid.size
        rows.append({"model": s.label, "method": method, "items counted (correct)": n_items,
                     "items": int(t.item_id.nunique()), "mean score": float(np.nanmean(grid.to_numpy()))
                     if n_items else float("nan"), "heads > 0.1": above, "heads": total})
        if n_items:
            lh = grid.stack().idxmax()
            finds.append(f"{s.label}: {above} of {total} heads score above 0.1 over {n_items} correctly answered "
                         f"items (best L{lh[0]}.H{lh[1]}, {grid.stack().max():.2f})")
        else:
            finds.append(f"{s.label}: no item was answered correctly, so no head could be scored (all cells 0 "
                         "in the heatmap mean 'not scored', not 'scored zero')")
    text = ("Wu et al.'s copy-paste score adapted to diffusion: at the step that committed each answer token, a head "
            "copies when its argmax key lies in the gold evidence and holds the emitted token (query p−1 for an "
            "ARM). Score = copied needle tokens / needle length, over correctly answered items; retrieval head > 0.1.")
    return Section("Retrieval heads", text, images, table=pd.DataFrame(rows).round(3),
                   finding="Measured: " + "; ".join(finds) + ".")


def flow_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("flow") is not None]
    if not have:
        return None
    images, rows, finds = [], [], []
    for s in have:
        t = s.table("flow")
        dens = t[t.metric == "answer_density"].copy()
        dens["region"] = dens["region"].where(dens["kind"] != "gold", "gold doc")
        dens["doc"] = dens["kind"].isin(["doc", "gold"])
        # one row per gold position; columns = non-document regions + "gold doc" + "other docs (mean)"
        dens.loc[dens.kind == "doc", "region"] = "other docs (mean)"
        table = dens.groupby(["gold_index", "region"], sort=False)["value"].mean().unstack("region")
        order = [c for c in ("bos", "gold doc", "other docs (mean)", "question_cue", "query", "answer_cue", "answer")
                 if c in table.columns]
        table = table[order].sort_index()
        flows = {f"gold doc {int(g) + 1}": table.loc[g].to_numpy() for g in table.index}
        gold = {k: order.index("gold doc") for k in flows} if "gold doc" in order else None
        path = img / f"flow_{s.label}.png"
        figures.region_flow(flows, order, gold, path=path, value_label="answer-row share / (region size / T)",
                            title=f"{s.label}: answer-row rollout flow by gold position (density-normalised)")
        images.append(path)
        item = t[t.region.isna()].pivot_table(index="item_id", columns="metric", values="value")
        ratio = float(item["gold_ratio_density"].mean())
        rows.append({"model": s.label, "items": len(item), "gold ratio (density)": ratio,
                     "row spread": float(item["row_spread"].mean()), "BOS share": float(item["bos_share"].mean())})
        finds.append(f"{s.label} gives the gold document {ratio:.2f}× the density-normalised share of the mean "
                     "distractor")
    text = ("Token-level attention rollout (residual 0.5, all layers) pooled to regions from one tokenisation; the "
            "answer row, divided by each region's length share to remove the length bias. Gold ratio = gold share / "
            "mean distractor share (1 = no preference). Rows that collapse to rank one have a small row spread.")
    return Section("Region-level attention flow", text, images, table=pd.DataFrame(rows).round(3),
                   finding="Measured: " + "; ".join(finds) + ".")


def _2f(x: float) -> str:
    """Two decimals, float noise (±1e-6) as 0.00 rather than -0.00."""
    return f"{0.0 if abs(x) < 5e-3 else x:.2f}"


def _per_item(t: pd.DataFrame, metric: str) -> pd.DataFrame:
    """[item, condition] values of one knockout metric (mean over steps for per-step metrics)."""
    return t[t.metric == metric].pivot_table(index="item_id", columns="condition", values="value")


def knockout_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("knockout") is not None]
    if not have:
        return None
    labels, a_eff, r_eff, a_err, r_err, rows, finds, empty = [], [], [], [], [], [], [], []
    for s in have:
        t = s.table("knockout")
        lp = _per_item(t, "answer_logprob")
        # drop of the gold answer's log-prob along the run's own path: clean − knockout (> 0: the knockout hurts)
        da, dr = lp["clean"] - lp["anchors"], lp["clean"] - lp.get("random", lp["clean"])
        means = {m: t[t.metric == m].groupby("condition")["value"].mean()
                 for m in ("tf_answer_logprob_mean", "answer_rank", "exact_match", "agreement", "n_targets")}
        labels.append(s.label)
        a_eff.append(float(da.mean()))
        r_eff.append(float(dr.mean()))
        a_err.append(float(da.std(ddof=0)))
        r_err.append(float(dr.std(ddof=0)))
        for cond in lp.columns:
            rows.append({"model": s.label, "condition": cond, "answer log-prob": float(lp[cond].mean()),
                         "teacher-forced answer log-prob": float(means["tf_answer_logprob_mean"].get(cond, np.nan)),
                         "gold rank": float(means["answer_rank"].get(cond, np.nan)),
                         "exact match": float(means["exact_match"].get(cond, np.nan)),
                         "agreement with clean": float(means["agreement"].get(cond, np.nan)),
                         "keys knocked per row": float(means["n_targets"].get(cond, np.nan)), "items": len(lp)})
        em = means["exact_match"]
        finds.append(f"{s.label}: knocking out anchors lowers the gold answer's log-prob by {_2f(da.mean())} nats vs "
                     f"{_2f(dr.mean())} for random keys; exact match {em.get('clean', np.nan):.2f} clean, "
                     f"{em.get('anchors', np.nan):.2f} anchors, {em.get('random', np.nan):.2f} random")
        if float(means["n_targets"].get("anchors", 0.0)) == 0.0:
            empty.append(s.label)
    path = img / "knockout.png"
    figures.knockout_effect(labels, a_eff, r_eff, a_err, r_err, path=path, xlabel="model", show_values=True,
                            ylabel="drop of gold-answer log-prob (nats)",
                            title="Knocking out anchors vs the same number of random keys (± std over items)")
    text = ("At every step and layer the scores from the still-masked (readout) queries to the detected anchors are "
            "set to −∞; the control removes as many random visible keys. Effect = clean − knockout log-probability "
            "of the gold answer, summed over its tokens, each read at the step that committed it in the knocked-out "
            "run (the log-probability the sampler gave the answer along its own path; > 0 means the knockout hurts). "
            "The table adds the teacher-forced log-prob (gold placed in the clean run's canvases), the gold tokens' "
            "mean rank (0 = argmax), exact match of the generated answer, and the share of generated tokens "
            "unchanged from the clean run.")
    if empty:
        text += (f" Bars at 0 for {', '.join(empty)}: the detector found no anchors there, so nothing was knocked "
                 "out and the random control removed nothing either.")
    return Section("Anchor knockout vs random control", text, [path], table=pd.DataFrame(rows).round(3),
                   finding="Measured: " + "; ".join(finds) + ".")
