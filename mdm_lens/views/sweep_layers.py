"""Report sections of a sweep that read per-item and per-layer tables: QA accuracy, absorption, temporal
floating and the QK decomposition. Each comparison is a :class:`~mdm_lens.views.stats.Claims` row (mean over
items, 95% bootstrap interval over items, n) and the finding states only what the interval supports."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from mdm_lens.sweep.summary import jaccard_defined
from mdm_lens.views import figures
from mdm_lens.views.report import Section
from mdm_lens.views.stats import Claims, bootstrap_mean, paired_difference, per_item

__all__ = ["accuracy_section", "absorption_section", "temporal_section", "qk_section", "BUILTIN"]

MAX_POSITION_FIGURES = 3            # passage counts drawn by gold position (the most common ones)


# --- accuracy ---------------------------------------------------------------------------------------

def _acc(t: pd.DataFrame, condition: str) -> pd.Series:
    return per_item(t[(t.metric == "acc") & (t.condition == condition)])


def _position_figures(sweeps: Sequence[Any], img: Path) -> tuple[list[Path], str]:
    """Accuracy by gold position, one figure per passage count (positions of prompts with other counts are
    different places), for the most common counts; and a sentence on what is (not) drawn."""
    ctx = {s.label: s.table("accuracy") for s in sweeps}
    ctx = {k: t[(t.metric == "acc") & (t.condition == "with_context")] for k, t in ctx.items()}
    gold = {k: t[t.gold_index.notna()] for k, t in ctx.items()}
    counts_text = ", ".join(f"{k} {gold[k].item_id.nunique()} of {t.item_id.nunique()}" for k, t in ctx.items())
    if not sum(len(t) for t in gold.values()):
        return [], (f"No item names a gold passage (with-context items naming one: {counts_text}), so accuracy by "
                    "gold position is not drawn.")
    counts = pd.concat(gold.values()).groupby("n_passages")["item_id"].nunique().sort_values(ascending=False)
    drawn = [int(k) for k in counts.index[:MAX_POSITION_FIGURES]]
    paths = []
    for k in drawn:
        series, n = {}, {}
        for label, t in gold.items():
            d = t[t.n_passages == k]
            if len(d):
                by = d.groupby("gold_index")["value"].mean().reindex(range(k))
                series[f"{label} (with context)"] = 100 * by.to_numpy()
                n[label] = d.item_id.nunique()
        path = img / f"accuracy_by_gold_position_{k}.png"
        figures.accuracy_curves(list(range(1, k + 1)), series, xlabel="position of the gold passage (1 = first)",
                                ylabel="accuracy (% of items, answer contained)", path=path,
                                title=f"Accuracy by gold position, with context, {k} passages "
                                      f"({', '.join(f'{m}: {v} items' for m, v in n.items())})")
        paths.append(path)
    rest = int(counts.iloc[len(drawn):].sum())
    note = (f"By gold position: with-context items naming a gold passage: {counts_text}; drawn for "
            f"{', '.join(map(str, drawn))} passages" + (f" ({rest} items with other counts are in "
                                                       "accuracy_summary.parquet)" if rest else "") + ".")
    return paths, note


def accuracy_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("accuracy") is not None]     # a maker called directly
    if not sweeps:
        return None
    claims, rows, gains, notes = Claims(), [], {}, []
    for s in sweeps:
        t = s.table("accuracy")
        w, c = _acc(t, "with_context"), _acc(t, "no_context")
        row = {"model": s.label, "with context (%)": 100 * w.mean(), "no context (%)": 100 * c.mean(),
               "items": len(w)}
        if not len(c):
            notes.append(f"{s.label} has no closed-book rows, so no gain")
        else:
            gains[s.label] = w - c
            iv = paired_difference(w, c)
            claims.add(f"{s.label}: with − without passages", iv, f"the passages help {s.label}",
                       f"the passages hurt {s.label}", f"{s.label} scores alike with and without the passages",
                       digits=1, scale=100, unit="points")
            row["gain (points)"] = 100 * iv.estimate
        rows.append(row)
    claims.rank(gains, "gain", "the passages help {a} more than {b}", "the passages help {a} and {b} alike",
                  digits=1, scale=100, unit="points")
    paths, note = _position_figures(sweeps, img)
    text = ("Accuracy = the normalised gold answer is a substring of the generated answer (the paper's lenient Acc; "
            "`em` and `f1` are in the table files), with the passages and with the closed-book variant of the same "
            "prompt; the gain is paired per item. " + note + "".join(f" {n[0].upper() + n[1:]}." for n in notes))
    return Section("QA accuracy with and without context", text, paths,
                   table=pd.DataFrame(rows).set_index("model").round(1), table_caption="accuracy (mean over items)",
                   claims=claims.table(), finding=claims.finding())


# --- absorption -------------------------------------------------------------------------------------

def _variants(t: pd.DataFrame, mode: str) -> list[str]:
    return sorted(t[(t["mode"] == mode) & (t.metric == "absorption")].variant.unique())


def _layer_curves(t: pd.DataFrame, mode: str, variant: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    d = t[(t["mode"] == mode) & (t.variant == variant)]
    g = lambda m: d[d.metric == m].groupby("layer")["value"]  # noqa: E731
    return (pd.DataFrame({"mean": g("absorption").mean(), "std": g("absorption").std(ddof=0),
                          "n": g("absorption").count()}), pd.DataFrame({"mean": g("null").mean()}))


def absorption_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("absorption") is not None]     # a maker called directly
    if not sweeps:
        return None
    tabs = {s.label: s.table("absorption") for s in sweeps}
    common = sorted(set.intersection(*(set(_variants(t, "default")) for t in tabs.values())))
    if not common:
        return None
    pick = "top1" if "top1" in common else common[0]
    curves, nulls, paper, rows, excess = {}, {}, {}, [], {}
    claims = Claims()
    for label, t in tabs.items():
        val, nul = _layer_curves(t, "default", pick)
        curves[f"{label} ({pick})"] = (val["mean"].to_numpy(), val["std"].to_numpy())
        nulls[f"{label} ({pick})"] = nul["mean"].to_numpy()
        for layer in val.index:
            rows.append({"model": label, "mode": "default", "variant": pick, "layer": int(layer),
                         "absorption (%)": val.loc[layer, "mean"], "std": val.loc[layer, "std"],
                         "uniform null (%)": nul.loc[layer, "mean"], "items": int(val.loc[layer, "n"])})
        for v in _variants(t, "paper"):
            p, _ = _layer_curves(t, "paper", v)
            paper[f"{label} ({v})"] = (p["mean"].to_numpy(), p["std"].to_numpy())
        d = t[(t["mode"] == "default") & (t.variant == pick) & (t.metric == "excess")]
        excess[label] = per_item(d)                  # per item: mean over layers of absorption − null
        claims.add(f"{label}: absorption − uniform null, mean over layers ({pick})", bootstrap_mean(excess[label]),
                   f"{label} absorbs more than uniform attention would ({pick})",
                   f"{label} absorbs less than uniform attention would ({pick})",
                   f"{label} absorbs as uniform attention would ({pick})", digits=1, unit="points")
    claims.rank(excess, f"absorption above null ({pick})", "{a} absorbs more above its null than {b}",
                  "{a} and {b} absorb alike above their nulls", digits=1, unit="points")
    p1, p2 = img / "absorption.png", img / "absorption_paper.png"
    figures.absorption_by_layer(curves, nulls, path=p1, title=f"Absorption by layer (default mode, {pick} for every model)")
    rules = sorted({k.rsplit("(", 1)[1].rstrip(")") for k in paper})
    figures.absorption_by_layer(paper, None, path=p2, title="Absorption by layer, paper mode ("
                                + ("anchor rules differ: " if len(rules) > 1 else "") + ", ".join(rules) + ")")
    text = (f"Absorb = share (%) of head-mean attention received by the anchor set on the clean final sequence "
            f"(prompt + generated answer), mean ± std over items. The default-mode figure and the comparisons use "
            f"the same anchor rule for every model ({pick}; top1 = the top-1 received key, pos0 = column 0), so "
            "they compare one statistic; the paper-mode figure keeps each family's own rule (ARMs pos0, MDMs top1), "
            "which are different statistics. Dashed = the same statistic under uniform attention with the same "
            "visibility.")
    return Section("Absorption by layer", text, [p1, p2], table=pd.DataFrame(rows).set_index("model").round(2),
                   table_caption=f"default mode, {pick}, per layer, over items", claims=claims.table(),
                   finding=claims.finding())


# --- temporal ---------------------------------------------------------------------------------------

def _temporal_skip(s: Any) -> str | None:
    return ("a causal model: each step emits the next token left to right, so its anchor sets over steps are not "
            "the denoising-step drift compared here" if s.causal else None)


def _heatmaps(s: Any, img: Path) -> list[Path]:
    keys = s.table("temporal_keys")
    if keys is None or not len(keys):
        return []
    first = keys[keys.item_id == keys.item_id.iloc[0]]
    paths = []
    for layer in sorted({int(first.layer.min()), int(first.layer.max())}):
        k = first[first.layer == layer]
        rec = k.pivot(index="step", columns="key", values="received").to_numpy(dtype=float)
        anc = k.pivot(index="step", columns="key", values="anchor").to_numpy().astype(bool)
        one = k[k.step == k.step.min()].sort_values("key")
        path = img / f"temporal_{s.label}_layer{layer}.png"
        figures.temporal_heatmap(rec, anc, one.token_str.tolist(), path=path,
                                 title=f"{s.label} layer {layer}: received attention per denoising step "
                                       f"(item {first.item_id.iloc[0]})",
                                 committed_step=one.commit_step.to_numpy(dtype=int),
                                 prompt_length=int(one.prompt_length.iloc[0]))
        paths.append(path)
    return paths


def temporal_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("temporal") is not None]     # a maker called directly
    if not sweeps:
        return None
    images, rows, claims = [], [], Claims()
    for s in sweeps:
        t = s.table("temporal")
        jd = jaccard_defined(t)
        drift = t[t.step.isna()]
        for layer in sorted(int(x) for x in t.layer.unique()):
            j = jd[(jd.layer == layer) & (jd.metric == "jaccard_defined")]
            e = jd[(jd.layer == layer) & (jd.metric == "n_empty_pairs")]
            dl = drift[drift.layer == layer]
            rows.append({"model": s.label, "layer": layer, "mean Jaccard of S_s, S_s+1": j.value.mean(),
                         "items with a defined Jaccard": int(j.value.notna().sum()),
                         "items excluded (every pair empty)": int(j.value.isna().sum()),
                         "empty pairs (both sets ∅), mean per item": e.value.mean(),
                         "distinct anchors": dl[dl.metric == "n_distinct"].value.mean(),
                         "top-1 change rate": dl[dl.metric == "top1_change_rate"].value.mean()})
        lo, hi = int(t.layer.min()), int(t.layer.max())
        if hi > lo:
            per = {l: per_item(jd[(jd.layer == l) & (jd.metric == "jaccard_defined")]) for l in (lo, hi)}
            claims.add(f"{s.label}: Jaccard at layer {hi} − layer {lo}", paired_difference(per[hi], per[lo]),
                       f"{s.label}'s anchor sets change less between steps at layer {hi} than at layer {lo}",
                       f"{s.label}'s anchor sets change more between steps at layer {hi} than at layer {lo}",
                       f"{s.label}'s anchor sets change alike at layers {lo} and {hi}")
        images += _heatmaps(s, img)
    text = ("Per denoising step, the head-mean attention each key receives from the non-pad queries, and its anchor "
            "set S_s (leave-one-out z-score rule). Heatmaps: the first item (shade = received attention, hatched = "
            "anchors, dots = the step that committed each canvas position). Table: drift over items. The Jaccard "
            "of two empty anchor sets is undefined: such step pairs are left out of the mean and counted, and an "
            "item whose every pair is empty is excluded (counted). Anchor positions (top-1 key, modal anchor) are "
            "not averaged over items of different lengths; they are per item in temporal.parquet.")
    return Section("Temporal floating", text, images, table=pd.DataFrame(rows).set_index("model").round(3),
                   table_caption="drift statistics, mean over items", claims=claims.table(), finding=claims.finding())


# --- qk ---------------------------------------------------------------------------------------------

def qk_section(sweeps: Sequence[Any], img: Path) -> Section | None:
    sweeps = [s for s in sweeps if s.table("qk") is not None]     # a maker called directly
    if not sweeps:
        return None
    images, rows, claims = [], [], Claims()
    for s in sweeps:
        t = s.table("qk")
        for layer in sorted({int(t.layer.min()), int(t.layer.max())}):
            d = t[t.layer == layer]
            heads = d.pivot_table(index="head", columns="metric", values="value", aggfunc="mean")
            path = img / f"qk_{s.label}_layer{layer}.png"
            figures.qk_decomposition_bars(heads["norm_term"].to_numpy(), heads["angle_term"].to_numpy(),
                                          [f"h{h}" for h in heads.index], path=path,
                                          title=f"{s.label} layer {layer}: anchor's QK advantage = norm + angle "
                                                "(mean over items)")
            images.append(path)
            item = {m: per_item(d[d.metric == m]) for m in ("norm_term", "angle_term", "advantage")}  # head mean
            adv = bootstrap_mean(item["advantage"])
            rows.append({"model": s.label, "layer": layer, "N (norm term)": item["norm_term"].mean(),
                         "G (angle term)": item["angle_term"].mean(), "Δ (advantage)": item["advantage"].mean(),
                         "items": adv.n})
            claims.add(f"{s.label} layer {layer}: advantage Δ = N + G", adv,
                       f"{s.label}'s top-1 key has a QK advantage at layer {layer}",
                       f"{s.label}'s top-1 key has a QK disadvantage at layer {layer}",
                       f"{s.label}'s top-1 key has no clear QK advantage at layer {layer}")
            if adv.verdict != "positive":
                continue            # "which term carries it" only makes sense for a positive advantage
            claims.add(f"{s.label} layer {layer}: G − N", paired_difference(item["angle_term"], item["norm_term"]),
                       f"the angle term carries more of {s.label}'s layer-{layer} advantage than the norm term",
                       f"the norm term carries more of {s.label}'s layer-{layer} advantage than the angle term",
                       f"the angle and norm terms carry {s.label}'s layer-{layer} advantage alike")
    text = ("For the top-1 received key j* per item, the mean QK logit advantage over the other visible keys, split "
            "exactly into a key-norm term N and an angle term G (post-RoPE), per head; per item the heads are "
            "averaged, then items. The statistic is the same for every model; the visible keys differ (causal vs "
            "bidirectional attention). Which term carries the advantage is stated only where the advantage itself is "
            "positive.")
    return Section("QK decomposition", text, images, table=pd.DataFrame(rows).set_index("model").round(3),
                   table_caption="mean over items", claims=claims.table(), finding=claims.finding())


BUILTIN = [dict(key="accuracy", make=accuracy_section, tables=("accuracy",)),
           dict(key="absorption", make=absorption_section, tables=("absorption",)),
           dict(key="temporal", make=temporal_section, tables=("temporal",), skip=_temporal_skip,
                title="Temporal floating"),
           dict(key="qk", make=qk_section, tables=("qk",))]
