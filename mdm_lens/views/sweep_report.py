"""`mdm-lens report DIR`: the HTML report of one or more sweep folders (figures, tables, one computed finding
per section). DIR is a sweep folder (it has ``manifest.json``) or a folder whose subfolders are sweeps; several
sweeps (e.g. an MDM and its ARM twin) are drawn side by side. The demo is a sweep plus this report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from mdm_lens.views import figures
from mdm_lens.views.report import Section, write_report

__all__ = ["report", "load_sweeps", "Sweep", "sections"]


class Sweep:
    """The sweep folder(s) of one model: manifests and lazily read tables (the first folder holding a table
    provides it, so e.g. a knockout sweep on fewer items can sit beside the main one)."""

    def __init__(self, roots: Sequence[Path]):
        self.roots = list(roots)
        self.manifests = [json.loads((r / "manifest.json").read_text()) for r in self.roots]
        self.manifest = self.manifests[0]
        self.model = self.manifest["model"]["id"]
        self.label = self.model.split("/")[-1]
        self.causal = self.manifest["model"].get("family") in ("llama", "qwen2") or "arm" in self.label
        self._cache: dict[str, pd.DataFrame | None] = {}

    def table(self, name: str) -> pd.DataFrame | None:
        if name not in self._cache:
            found = [r / f"{name}.parquet" for r in self.roots if (r / f"{name}.parquet").exists()]
            self._cache[name] = pd.read_parquet(found[0]) if found else None
        return self._cache[name]

    @property
    def n_items(self) -> int:
        return max(int(m["items_done"]) for m in self.manifests)


def load_sweeps(folder: str | Path) -> list[Sweep]:
    """The sweeps in ``folder`` (itself, or its subfolders), grouped by model id in first-seen order."""
    folder = Path(folder)
    if (folder / "manifest.json").exists():
        return [Sweep([folder])]
    roots = [p for p in sorted(folder.iterdir()) if (p / "manifest.json").exists()] if folder.is_dir() else []
    if not roots:
        from mdm_lens.errors import InputError

        raise InputError(f"{folder} is not a sweep folder (no manifest.json) and has no sweep subfolders; run "
                         "`mdm-lens sweep ... --out DIR` first.")
    groups: dict[str, list[Path]] = {}
    for r in roots:
        groups.setdefault(json.loads((r / "manifest.json").read_text())["model"]["id"], []).append(r)
    return [Sweep(rs) for rs in groups.values()]


def _pct(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


# --- sections ---------------------------------------------------------------------------------------

def accuracy_section(sweeps: Sequence[Sweep], img: Path) -> Section | None:
    have = [(s, s.table("accuracy_summary")) for s in sweeps if s.table("accuracy_summary") is not None]
    if not have:
        return None
    rows, series, finds, positions = [], {}, [], None
    for s, t in have:
        ov = t[(t.group == "overall") & (t.metric == "acc")].set_index("condition")
        w, c = float(ov.loc["with_context", "mean"]), float(ov.loc["no_context", "mean"])
        rows.append({"model": s.label, "with context (%)": 100 * w, "no context (%)": 100 * c,
                     "gain (points)": 100 * (w - c), "items": int(ov.loc["with_context", "n"])})
        finds.append(f"{s.label} {_pct(w)} with context vs {_pct(c)} without (gain {100 * (w - c):+.0f} points)")
        pos = t[(t.group == "by_gold_position") & (t.metric == "acc")].sort_values("gold_index")
        positions = pos["gold_index"].astype(int).tolist() if positions is None else positions
        series[f"{s.label} (with context)"] = pos.set_index("gold_index")["mean"].reindex(positions).to_numpy() * 100
    path = img / "accuracy_by_gold_position.png"
    figures.accuracy_curves([p + 1 for p in positions], series, xlabel="position of the gold passage (1 = first)",
                            ylabel="accuracy (% of items, answer contained)", title="Accuracy by gold position",
                            path=path)
    best = max(rows, key=lambda r: r["gain (points)"])
    text = ("Accuracy = the normalised gold answer is a substring of the generated answer (the paper's lenient Acc; "
            "`em` and `f1` are in the table files), with the passages and with the closed-book variant of the same "
            "prompt. The figure splits the with-context accuracy by where the gold passage sits.")
    finding = ("Measured: " + "; ".join(finds) + f". The passages help {best['model']} most "
               f"({best['gain (points)']:+.0f} points).")
    return Section("QA accuracy with and without context", text, [path],
                   table=pd.DataFrame(rows).set_index("model").round(1), table_caption="accuracy", finding=finding)


def _variant(s: Sweep) -> str:
    return "pos0" if s.causal else "top1"


def absorption_section(sweeps: Sequence[Sweep], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("absorption_summary") is not None]
    if not have:
        return None
    curves, nulls, paper, rows, finds = {}, {}, {}, [], []
    for s in have:
        t = s.table("absorption_summary")
        v = _variant(s)
        d = t[(t["mode"] == "default") & (t.variant == v)]
        val = d[d.metric == "absorption"].sort_values("layer")
        nul = d[d.metric == "null"].sort_values("layer")
        key = f"{s.label} ({v})"
        curves[key] = (val["mean"].to_numpy(), val["std"].to_numpy())
        nulls[key] = nul["mean"].to_numpy()
        p = t[(t["mode"] == "paper") & (t.metric == "absorption")].sort_values("layer")
        paper[f"{s.label} (paper)"] = (p["mean"].to_numpy(), p["std"].to_numpy())
        for (_, a), (_, n) in zip(val.iterrows(), nul.iterrows()):
            rows.append({"model": s.label, "variant": v, "layer": int(a.layer), "absorption (%)": a["mean"],
                         "std": a["std"], "uniform null (%)": n["mean"], "items": int(a.n)})
        finds.append(f"{s.label} {val['mean'].mean():.1f}% ({v}; uniform null {nul['mean'].mean():.1f}%)")
    p1, p2 = img / "absorption.png", img / "absorption_paper.png"
    figures.absorption_by_layer(curves, nulls, title="Absorption by layer (default mode), with uniform nulls",
                                path=p1)
    figures.absorption_by_layer(paper, None, title="Absorption by layer, paper mode", path=p2)
    excess = {s.label: float(np.mean(curves[f"{s.label} ({_variant(s)})"][0] - nulls[f"{s.label} ({_variant(s)})"]))
              for s in have}
    top = max(excess, key=excess.get)
    text = ("Absorb = share (%) of head-mean attention received by the anchor set, on the clean final sequence "
            "(prompt + generated answer), mean ± std over items. ARMs: column 0 (pos0); MDMs: the top-1 received "
            "key (top1); dashed = the same statistic under uniform attention with the same visibility.")
    finding = (f"Measured, mean over layers: {'; '.join(finds)}. {top} absorbs the most above its null "
               f"({excess[top]:+.1f} points).")
    return Section("Absorption by layer", text, [p1, p2], table=pd.DataFrame(rows).round(2),
                   table_caption="per layer, over items", finding=finding)


def temporal_section(sweeps: Sequence[Sweep], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("temporal") is not None and not s.causal]
    if not have:
        return None
    images, rows, finds = [], [], []
    for s in have:
        t, keys = s.table("temporal"), s.table("temporal_keys")
        drift = t[t.step.isna()]
        jac = drift[drift.metric == "mean_jaccard"].groupby("layer")["value"].mean()
        nd = drift[drift.metric == "n_distinct"].groupby("layer")["value"].mean()
        ch = drift[drift.metric == "top1_change_rate"].groupby("layer")["value"].mean()
        for layer in jac.index:
            rows.append({"model": s.label, "layer": int(layer), "mean Jaccard of S_s, S_s+1": jac[layer],
                         "distinct anchors": nd[layer], "top-1 change rate": ch[layer]})
        finds.append(f"{s.label}: anchor sets overlap {jac.iloc[0]:.2f} (Jaccard) between steps at layer "
                     f"{int(jac.index[0])} and {jac.iloc[-1]:.2f} at layer {int(jac.index[-1])}")
        if keys is None or not len(keys):
            continue
        first = keys[keys.item_id == keys.item_id.iloc[0]]
        for layer in (int(first.layer.min()), int(first.layer.max())):
            k = first[first.layer == layer]
            rec = k.pivot(index="step", columns="key", values="received").to_numpy()
            anc = k.pivot(index="step", columns="key", values="anchor").to_numpy().astype(bool)
            one = k[k.step == k.step.min()].sort_values("key")
            path = img / f"temporal_{s.label}_layer{layer}.png"
            figures.temporal_heatmap(rec, anc, one.token_str.tolist(), path=path,
                                     title=f"{s.label} layer {layer}: received attention per denoising step "
                                           f"(item {first.item_id.iloc[0]})",
                                     committed_step=one.commit_step.to_numpy(),
                                     prompt_length=int(one.prompt_length.iloc[0]))
            images.append(path)
    text = ("Per denoising step, the head-mean attention each key receives from the non-pad queries, and its anchor "
            "set S_s (leave-one-out z-score rule). Heatmaps: the first item (shade = received attention, hatched = "
            "anchors, dots = the step that committed each canvas position). Table: drift over items.")
    return Section("Temporal floating", text, images, table=pd.DataFrame(rows).round(3),
                   table_caption="drift statistics, mean over items", finding="Measured: " + "; ".join(finds) + ".")


def qk_section(sweeps: Sequence[Sweep], img: Path) -> Section | None:
    have = [s for s in sweeps if s.table("qk_summary") is not None]
    if not have:
        return None
    images, finds = [], []
    rows = []
    for s in have:
        t = s.table("qk_summary")
        for layer in (int(t.layer.min()), int(t.layer.max())):
            d = t[t.layer == layer].pivot(index="head", columns="metric", values="mean")
            path = img / f"qk_{s.label}_layer{layer}.png"
            figures.qk_decomposition_bars(d["norm_term"].to_numpy(), d["angle_term"].to_numpy(),
                                          [f"h{h}" for h in d.index], path=path,
                                          title=f"{s.label} layer {layer}: anchor's QK advantage = norm + angle")
            images.append(path)
            share = float(d["angle_term"].sum() / d["advantage"].sum()) if d["advantage"].sum() else float("nan")
            rows.append({"model": s.label, "layer": layer, "N (norm term)": d["norm_term"].mean(),
                         "G (angle term)": d["angle_term"].mean(), "Δ": d["advantage"].mean(), "G/Δ": share})
            finds.append(f"{s.label} layer {layer}: G/Δ = {share:.2f}")
    text = ("For the top-1 received key j* per item, the mean QK logit advantage over the other visible keys, split "
            "exactly into a key-norm term N and an angle term G (post-RoPE, per head), mean over items.")
    angle = [r for r in rows if np.isfinite(r["G/Δ"]) and r["G/Δ"] >= 0.5]
    finding = (f"Measured: {'; '.join(finds)}. The angle term carries most of the advantage in {len(angle)} of "
               f"{len(rows)} (model, layer) cases.")
    return Section("QK decomposition", text, images, table=pd.DataFrame(rows).round(3), finding=finding)


from mdm_lens.views.sweep_sections import flow_section, knockout_section, retrieval_section  # noqa: E402
from mdm_lens.views.fig_lens import lens_section  # noqa: E402
from mdm_lens.views.fig_probes import probes_section  # noqa: E402


def sections(sweeps: Sequence[Sweep], img: Path) -> list[Section]:
    makers = (accuracy_section, absorption_section, temporal_section, qk_section, retrieval_section, flow_section,
              knockout_section, lens_section, probes_section)
    return [sec for make in makers if (sec := make(sweeps, img)) is not None]


def report(folder: str | Path, out: str | Path | None = None, title: str | None = None,
           extra: Sequence[Section] = (), meta: dict[str, Any] | None = None) -> Path:
    """Write ``out/index.html`` (default ``folder/report``) from the sweep(s) in ``folder``; returns its path."""
    sweeps = load_sweeps(folder)
    out = Path(out) if out is not None else Path(folder) / "report"
    img = out / "figures"
    img.mkdir(parents=True, exist_ok=True)
    secs = sections(sweeps, img) + list(extra)
    info = {"sweeps": ", ".join(f"{s.label} ({s.n_items} items)" for s in sweeps),
            "probes": ", ".join(dict.fromkeys(p for s in sweeps for m in s.manifests for p in m["arguments"]["probes"])),
            "canvas": f"gen_length {sweeps[0].manifest['arguments']['gen_length']}, steps "
                      f"{sweeps[0].manifest['arguments']['steps']}",
            **(meta or {})}
    return write_report(out, title or "mdm_lens sweep report: " + " vs ".join(s.label for s in sweeps), secs, info)
