"""`mdm-lens demo`: the paper's analyses on the shipped tiny twins, written as an offline HTML report.

Loads `mdm-lens/tiny-mdm` and `mdm-lens/tiny-arm` (same size, data and tokenizer; bidirectional vs
causal) and runs: QA accuracy with/without the gold passage, vs distractors and gold position;
absorption per layer (default and paper modes, with uniform nulls); the temporal floating heatmap;
the QK norm/angle split at a shallow and a deep layer; retrieval-head scores; region flow for gold
first/middle/last; anchor knockout vs a random control; circuitsvis views of attention at chosen steps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch

from mdm_lens import HookedMDM, ReceivedAttention, steps
from mdm_lens.errors import MDMLensError
from mdm_lens.probes import patching, retrieval
from mdm_lens.probes import run as R
from mdm_lens.views import circuits, figures
from mdm_lens.views.report import Section, write_report
from mdm_lens.zoo import data as D
from mdm_lens.zoo import evaluate as E
from mdm_lens.zoo import tokenizer as ZT

TWINS = {"MDM": "mdm-lens/tiny-mdm", "ARM": "mdm-lens/tiny-arm"}


class _Progress:
    """One line per stage with its wall time: the demo's progress report."""

    def __init__(self, n: int):
        self.n, self.i, self.t0 = n, 0, time.perf_counter()

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        self.i += 1
        t = time.perf_counter()
        print(f"[{self.i}/{self.n}] {name} …", end="", flush=True)
        result = fn()
        print(f" {time.perf_counter() - t:.1f}s", flush=True)
        return result

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def load_twins() -> dict[str, HookedMDM]:
    try:
        return {k: HookedMDM.from_pretrained(v) for k, v in TWINS.items()}
    except MDMLensError as e:
        raise SystemExit(f"the shipped twins could not be loaded ({e}). Rebuild them with "
                         "`python -m mdm_lens.zoo.train` (≈25 min on 2 CPU cores).") from e


def _prompts(items: list[D.QAItem]) -> list[torch.Tensor]:
    return [torch.tensor(ZT.encode(it.prompt)) for it in items]


# --- analyses (each returns a Section) ---------------------------------------------------------------

def accuracy_section(twins: dict[str, HookedMDM], n: int, out: Path) -> Section:
    """A live check on `n` items (with / without the gold passage) beside the zoo's 500-item evaluation
    (`assets/results.json` and its PNGs, made by `python -m mdm_lens.zoo.evaluate`): re-running the
    full sweeps would take most of the demo's time budget."""
    import json
    import shutil

    from mdm_lens.zoo.train import ASSETS, NAMES

    shipped = json.loads((ASSETS / "results.json").read_text())
    is_shipped = all(m.cfg.model_name == NAMES.get(k.lower()) for k, m in twins.items())
    rows = []
    for name, model in twins.items():
        ev = shipped.get(name.lower(), {}).get("eval", {}) if is_shipped else {}
        live_ctx = E.accuracy(model, D.make_dataset(n, seed=1234, n_distractors=4))["exact_match"]
        live_closed = E.accuracy(model, D.make_dataset(n, seed=1234, no_context=True))["exact_match"]
        row = dict(model=name, live_with_context=100 * live_ctx, live_no_context=100 * live_closed)
        for key, label in (("with_context", "with context"), ("no_context", "no context"),
                           *((f"distractors_{k}", f"k={k}") for k in E.DISTRACTOR_SWEEP),
                           *((f"gold_{p}", f"gold@{p}") for p in E.POSITION_SWEEP),
                           *((f"hard_{h:g}", f"hard {h:g}") for h in E.HARDNESS_SWEEP)):
            if key in ev:
                row[f"500: {label}"] = 100 * ev[key]["exact_match"]
        rows.append(row)
    images = []
    for fname in ("acc_distractors.png", "acc_position.png"):
        if is_shipped and (ASSETS / fname).exists():
            images.append(Path(shutil.copy(ASSETS / fname, out / fname)))
    text = (f"Exact match (%). 'live' = scored now on the first {n} items of the held-out set (seed 1234, 4 "
            "distractors) and its closed-book twin; '500' = the zoo's evaluation of the same shipped weights, 500 "
            "items per setting (figures: 95% Wilson bands; the twins were trained on 0–4 distractors; 'hard h' = "
            "share of the 4 distractors that use the question's relation: at 1 only subject matching beats 20%). Greedy "
            "decoding; the MDM fills its 4-slot answer canvas one token per step by highest confidence. Facts are "
            f"sampled fresh for every item, so closed-book accuracy is chance ({100 * E.type_chance():.1f}% for "
            "guessing the right answer type): the gain is what the model reads from the gold passage.")
    return Section("QA accuracy of the twins", text, images, table=pd.DataFrame(rows).set_index("model").round(1),
                   table_caption="exact match (%)")


def absorption_section(twins: dict[str, HookedMDM], n: int, out: Path) -> tuple[Section, dict]:
    prompts = _prompts(D.make_dataset(n, seed=2024, n_distractors=4))
    curves, nulls, paper_curves, tables, summary = {}, {}, {}, [], {}
    for name, model in twins.items():
        toks, am, _ = R.generate_final(model, prompts)
        default = R.absorption_by_layer(model, toks, attention_mask=am, mode="default")
        paper = R.absorption_by_layer(model, toks, attention_mask=am, mode="paper")
        variant = "pos0" if name == "ARM" else "top1"
        v = default.variants.index(variant)
        curves[f"tiny-{name.lower()} ({variant})"] = (default.mean[:, v], default.std[:, v])
        summary[name] = float(default.mean[:, v].mean())
        nulls[f"tiny-{name.lower()} ({variant})"] = default.null_mean[:, v]
        paper_curves[f"tiny-{name.lower()} (paper)"] = (paper.mean[:, 0], paper.std[:, 0])
        t = default.table().add_prefix(f"{name} ")
        t[f"{name} paper"] = paper.table().iloc[:, 0]
        tables.append(t)
    figures.absorption_by_layer(curves, nulls, title="Absorption by layer: ARM column 0 vs MDM top-1, with nulls",
                                path=out / "absorption.png")
    figures.absorption_by_layer(paper_curves, None, title="Absorption by layer, paper mode (AF reference)",
                                path=out / "absorption_paper.png")
    table = pd.concat(tables, axis=1).round(1)
    keep = [c for c in table.columns if not c.endswith("_std")]
    text = ("Absorb = share (%) of head-mean attention received by the anchor set, on the clean final sequence. "
            "Default mode reports pos0 / top1 / anchors (leave-one-out z-score, ε=3, mass floor 2/|V|) for both "
            "models with the uniform-attention null under the same visibility (causal column 0: H_T/T; "
            "bidirectional: 1/T). Paper mode reproduces the reference: MDM = Rule A, which can never fire and "
            "falls back to top-1; ARM = column 0.")
    return Section("Absorption by layer (ARM vs MDM)", text, [out / "absorption.png", out / "absorption_paper.png"],
                   table=table[keep], table_caption="per-layer means over samples"), summary


def temporal_section(model: HookedMDM, out: Path) -> tuple[Section, Any]:
    item = D.make_dataset(1, seed=5, n_distractors=4)[0]
    prompt = torch.tensor(ZT.encode(item.prompt))
    gen = int(model.cfg.extra.get("gen_length", 4))  # the canvas the twins were trained on; a longer one is
    # out of distribution (at 8 slots the MDM copies prompt words into the spare slots and answers worse)
    run = model.generate(prompt, steps=gen, gen_length=gen, record=[ReceivedAttention()],
                         cache="blocks.0.attn.hook_pattern" @ steps(0, -1))
    images, rows = [], []
    for layer in (0, model.cfg.n_layers - 1):
        sa = R.anchors_over_steps(run, layer=layer)
        drift = R.drift_from_output(run, layer=layer)
        labels = model.to_str_tokens(run.tokens[0])  # the final tokens, so every position is readable
        path = out / f"temporal_layer{layer}.png"
        figures.temporal_heatmap(sa.received[0].numpy(), sa.anchors[0].numpy(), labels,
                                 title=f"tiny-mdm layer {layer}: received attention per denoising step",
                                 path=path, committed_step=run.trajectory.commit_step[0].numpy(),
                                 prompt_length=run.prompt_length)
        images.append(path)
        rows.append(dict(layer=layer, mean_jaccard=float(drift.mean_jaccard[0]), distinct=int(drift.n_distinct[0]),
                         stability=float(drift.stability[0]), modal_anchor=int(drift.modal_anchor[0]),
                         top1_change_rate=float(drift.top1_change_rate[0]),
                         centroid_slope=float(drift.centroid_slope[0])))
    text = (f"One item, {gen} denoising steps (one token per step, low-confidence remasking, the {gen}-token canvas "
            "the twins were trained on: answer + EOS fill). Shade = head-mean received attention c_j(s); hatched = anchors (z-score rule); "
            "dots = the step at which each canvas position was committed.")
    return Section("Temporal floating (MDM)", text, images, table=pd.DataFrame(rows).round(3),
                   table_caption="drift statistics"), run


def qk_section(model: HookedMDM, n: int, out: Path) -> Section:
    prompts = _prompts(D.make_dataset(n, seed=31, n_distractors=4))
    toks, am, _ = R.generate_final(model, prompts)
    images, rows = [], []
    for layer in (0, model.cfg.n_layers - 1):
        dec = R.qk_at_layer(model, toks, layer, attention_mask=am)
        path = out / f"qk_layer{layer}.png"
        figures.qk_decomposition_bars(dec.norm_term.mean(0).numpy(), dec.angle_term.mean(0).numpy(),
                                      [f"h{h}" for h in range(model.cfg.n_heads)],
                                      title=f"tiny-mdm layer {layer}: anchor's QK advantage = norm + angle",
                                      path=path)
        images.append(path)
        for h in range(model.cfg.n_heads):
            labels, counts = np.unique(dec.labels[:, h], return_counts=True)
            rows.append(dict(layer=layer, head=h, N=float(dec.norm_term[:, h].mean()),
                             G=float(dec.angle_term[:, h].mean()), delta=float(dec.advantage[:, h].mean()),
                             key_norm_ratio=float(dec.key_norm_ratio[:, h].mean()),
                             cos_gap=float(dec.cos_gap[:, h].mean()), label=str(labels[counts.argmax()])))
    text = ("For the top-1 received key j* (per sample), the mean QK logit advantage over the other visible keys, "
            "split exactly (two-factor Shapley) into a key-norm term N and an angle term G (post-RoPE, per head). "
            "Labels: angle-driven (G/Δ ≥ 0.8 or N ≤ 0), norm-driven (N/Δ ≥ 0.8), combined.")
    return Section("QK decomposition (shallow vs deep layer)", text, images, table=pd.DataFrame(rows).round(3),
                   table_caption="per head, mean over samples")


def retrieval_section(twins: dict[str, HookedMDM], n: int, out: Path) -> Section:
    items = D.make_dataset(n, seed=404, n_distractors=4)
    images, rows = [], []
    for name, model in twins.items():
        method = "wu" if name == "ARM" else "copy@commit"
        scores = retrieval.retrieval_scores(model, items, method=method)
        focus = retrieval.retrieval_scores(model, items, method="evidence_focus")
        path = out / f"retrieval_{name.lower()}.png"
        figures.retrieval_heatmap(np.nan_to_num(scores.scores.numpy()),
                                  title=f"tiny-{name.lower()} retrieval score ({method}, {scores.n_counted} correct)",
                                  path=path)
        images.append(path)
        s = scores.scores
        rows.append(dict(model=name, method=method, counted=int(scores.n_counted),
                         mean=float(np.nanmean(s.numpy())) if scores.n_counted else float("nan"),
                         heads_over_0_1=len(scores.retrieval_heads),
                         evidence_focus_mean=float(np.nanmean(focus.scores.numpy())) if focus.n_counted else float("nan")))
    text = ("Wu et al.'s copy-paste score adapted to diffusion: at the step that committed each answer token, a head "
            "copies when its argmax key lies in the gold evidence and holds the emitted token (query p−1 for the "
            "ARM). Score = copied needle tokens / needle length over correctly answered items; retrieval head > 0.1. "
            "`evidence_focus` (argmax in the gold passage, no identity check) is the lax variant.")
    return Section("Retrieval heads", text, images, table=pd.DataFrame(rows).round(3))


def flow_section(twins: dict[str, HookedMDM], n: int, out: Path) -> Section:
    images, rows = [], []
    for name, model in twins.items():
        flows, gold = {}, {}
        labels: list[str] = []
        for pos in ("first", "middle", "last"):
            items = D.make_dataset(n, seed=90, n_distractors=4, gold_position=pos)
            res = R.flow_for_items(model, items)
            df = res.to_frame(metrics=("answer_density",))
            df = df[df.metric == "answer_density"]
            df = df.assign(region=np.where(df.kind == "gold", "gold doc", df.region))
            mean = df.groupby("region", sort=False)["value"].mean()
            labels = labels or list(mean.index)
            flows[pos] = mean.reindex(labels).to_numpy()
            gold[pos] = labels.index("gold doc") if "gold doc" in labels else -1
            rows.append(dict(model=name, gold=pos, gold_ratio=float(np.nanmean(res.gold_ratio_density.numpy())),
                             row_spread=float(np.mean([float(r.row_spread) for r in res.results]))))
        path = out / f"flow_{name.lower()}.png"
        figures.region_flow(flows, labels, gold, title=f"tiny-{name.lower()}: Answer-row rollout flow "
                            "(density-normalised)", path=path, value_label="share / (region size / T)")
        images.append(path)
    text = ("Token-level attention rollout (residual 0.5, all layers) pooled to regions from one tokenisation; the "
            "Answer row, divided by each region's length share (to remove the length bias). Gold ratio = gold "
            "share / mean distractor share. Rows that collapse to rank one (small row spread) are flagged by the "
            "probe.")
    return Section("Region-level attention flow", text, images, table=pd.DataFrame(rows).round(3))


def knockout_section(twins: dict[str, HookedMDM], n: int, out: Path) -> Section:
    items = D.make_dataset(n, seed=606, n_distractors=4)
    conds, anchor_eff, random_eff, rows = [], [], [], []
    for name, model in twins.items():
        res = [patching.knockout(model, p, answer=it.answer, n_random=2, seed=i)
               for i, (p, it) in enumerate(zip(_prompts(items), items))]
        metric = np.array([r.metric_mean.numpy() for r in res])  # [item, condition]
        c = res[0].conditions
        clean = metric[:, c.index("clean")]
        for cond in c:
            agree = np.mean([float(r.agreement[c.index(cond)]) for r in res])
            knocked = float(np.mean([float(r.n_targets[c.index(cond)].mean()) for r in res]))
            rows.append(dict(model=name, condition=cond, logit_margin=float(metric[:, c.index(cond)].mean()),
                             agreement_with_clean=agree, keys_knocked=knocked))
        conds.append(f"tiny-{name.lower()}")
        anchor_eff.append(float((clean - metric[:, c.index("anchors")]).mean()))
        random_eff.append(float((clean - metric[:, c.index("random")]).mean()))
    figures.knockout_effect(conds, anchor_eff, random_eff, ylabel="drop of committed-token logit margin",
                            title="Knocking out anchors vs the same number of random keys", path=out / "knockout.png")
    text = ("At every step and layer, the scores from the still-masked (readout) queries to the detected anchors "
            "are set to −∞ (anchors detected on the unablated step); the control removes the same number of random "
            "visible keys. Effect = drop of the committed token's logit margin (teacher-forced on the clean "
            "trajectory); agreement = fraction of generated tokens unchanged after full sampling; keys_knocked = mean "
            "number of keys removed per query row and layer (0 = the detector found no anchors, so there was "
            "nothing to knock out and the random control removes nothing either).")
    return Section("Anchor knockout vs random control", text, [out / "knockout.png"], table=pd.DataFrame(rows).round(3))


def views_section(model: HookedMDM, run: Any) -> Section:
    html = [circuits.attention(run, 0, 0, model), circuits.attention(run, -1, 0, model)]
    drift = R.drift_from_output(run, layer=0)
    labels = model.to_str_tokens(run.tokens[0])
    html.append(circuits.tokens_by_persistence(labels, drift.persistence[0].numpy()))
    text = ("Layer 0 attention of the MDM at the first and the last denoising step ([MASK] = still masked), and "
            "the final tokens coloured by anchor persistence across steps. Rendered from the circuitsvis bundle "
            "inlined in this page: no network needed.")
    return Section("Interactive attention (circuitsvis)", text, html=html)


def run_demo(out: str = "mdm_lens_report", quick: bool = False, n: int | None = None) -> Path:
    """Write the report to `out` and return its index.html. `n` = samples per analysis (default 64: about
    15 s of analyses on 2 idle CPU cores, far inside the 3-minute budget; `quick` = 12); the live QA check uses 4n items per
    setting beside the zoo's shipped 500-item evaluation."""
    folder = Path(out)
    img = folder / "figures"
    img.mkdir(parents=True, exist_ok=True)
    n = n or (12 if quick else 64)
    torch.manual_seed(0)
    p = _Progress(9)
    twins = p.stage("loading the twins", load_twins)
    sections = [p.stage("QA accuracy", lambda: accuracy_section(twins, 4 * n, img))]
    absorb, summary = p.stage("absorption by layer", lambda: absorption_section(twins, n, img))
    sections.append(absorb)
    temporal, run = p.stage("temporal floating", lambda: temporal_section(twins["MDM"], img))
    sections.append(temporal)
    sections.append(p.stage("QK decomposition", lambda: qk_section(twins["MDM"], n // 2, img)))
    sections.append(p.stage("retrieval heads", lambda: retrieval_section(twins, max(4, n // 2), img)))
    sections.append(p.stage("region flow", lambda: flow_section(twins, max(2, n // 4), img)))
    sections.append(p.stage("anchor knockout", lambda: knockout_section(twins, max(2, n // 6), img)))
    sections.append(p.stage("circuitsvis views", lambda: views_section(twins["MDM"], run)))
    meta = {"models": ", ".join(TWINS.values()), "samples per analysis": n,
            "mean absorption (MDM top1 / ARM pos0, %)": f"{summary['MDM']:.1f} / {summary['ARM']:.1f}",
            "wall time (s)": f"{p.elapsed:.0f}"}
    index = write_report(folder, "mdm_lens demo: attention floating in the tiny twins", sections, meta)
    print(f"report: {index.resolve()}  ({p.elapsed:.0f}s)")
    return index
