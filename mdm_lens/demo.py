"""`mdm-lens demo`: a small sweep over the shipped tiny twins plus `mdm-lens report` on it.

One code path with dataset-scale runs: the zoo's synthetic QA items are exported as jsonl
(`mdm-lens zoo export`), each twin (`mdm-lens/tiny-mdm`, bidirectional; `mdm-lens/tiny-arm`, causal) is
swept with `mdm_lens.sweep.run` (accuracy with / without context, absorption, temporal floating, QK split,
retrieval heads, region flow on n items; anchor knockout, the slow one, on fewer), and the report is
`mdm_lens.views.sweep_report.report` on the sweep folders. Two demo-only sections are appended: the zoo's
shipped 500-item evaluation and circuitsvis views of one run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch

from mdm_lens import HookedMDM, ReceivedAttention, steps
from mdm_lens import sweep
from mdm_lens.errors import MDMLensError
from mdm_lens.probes import run as R
from mdm_lens.views import circuits
from mdm_lens.views.report import Section
from mdm_lens.views.sweep_report import report
from mdm_lens.zoo import data as D
from mdm_lens.zoo import evaluate as E
from mdm_lens.zoo import jsonl
from mdm_lens.zoo import tokenizer as ZT

TWINS = {"MDM": "mdm-lens/tiny-mdm", "ARM": "mdm-lens/tiny-arm"}
MAIN_PROBES = "accuracy,absorption,temporal,qk,retrieval,flow"
DATA_SEED = 2024


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


def sweep_twins(twins: dict[str, HookedMDM], data: Path, root: Path, n: int, n_knockout: int) -> None:
    """The demo's sweeps: ``root/{twin}-main`` (n items) and ``root/{twin}-knockout`` (n_knockout items)."""
    for name, model in twins.items():
        label = model.cfg.model_name.split("/")[-1]
        sweep.run(model, data, MAIN_PROBES, root / f"{label}-main", limit=n, batch_size=16, force=True,
                  progress=False)
        sweep.run(model, data, "knockout", root / f"{label}-knockout", limit=n_knockout, batch_size=8, force=True,
                  progress=False)


def shipped_evaluation_section(twins: dict[str, HookedMDM], img: Path) -> Section | None:
    """The zoo's 500-item evaluation of the same shipped weights (``assets/results.json`` and its PNGs)."""
    from mdm_lens.zoo.recipe import ASSETS, NAMES

    shipped = json.loads((ASSETS / "results.json").read_text())
    if not all(m.cfg.model_name == NAMES.get(k.lower()) for k, m in twins.items()):
        return None
    rows = []
    for name in twins:
        ev = shipped.get(name.lower(), {}).get("eval", {})
        row = {"model": name}
        for key, label in (("with_context", "with context"), ("no_context", "no context"),
                           *((f"distractors_{k}", f"k={k}") for k in E.DISTRACTOR_SWEEP),
                           *((f"gold_{p}", f"gold@{p}") for p in E.POSITION_SWEEP),
                           *((f"hard_{h:g}", f"hard {h:g}") for h in E.HARDNESS_SWEEP)):
            if key in ev:
                row[label] = 100 * ev[key]["exact_match"]
        rows.append(row)
    img.mkdir(parents=True, exist_ok=True)  # a fresh --out folder has no figures/ yet
    images = [Path(shutil.copy(ASSETS / f, img / f)) for f in ("acc_distractors.png", "acc_position.png")
              if (ASSETS / f).exists()]
    table = pd.DataFrame(rows).set_index("model").round(1)
    text = ("Exact match (%) from the zoo's evaluation: 500 items per setting (figures: 95% Wilson bands; trained on "
            "0–4 distractors; 'hard h' = share of distractors that use the question's relation). Facts are sampled "
            f"fresh per item, so closed-book accuracy is chance ({100 * E.type_chance():.1f}% for the right answer "
            "type).")
    w = table["with context"] if "with context" in table else None
    finding = ("Measured on 500 items: " + "; ".join(f"{m} {w[m]:.0f}% with context vs {table.loc[m, 'no context']:.0f}% "
                                                      "without" for m in table.index) + "."
               if w is not None and "no context" in table else "")
    return Section("QA accuracy: the zoo's 500-item evaluation", text, images, table=table,
                   table_caption="exact match (%)", finding=finding)


def diffusion_gemma_section(figures: Path) -> Section | None:
    """The transformers-native bridge on a tiny RANDOM-weight DiffusionGemma (needs transformers >= 5.11)."""
    try:
        from mdm_lens.bridge.demo import diffusion_gemma_section as build
        material = build(figures)
    except ImportError as e:  # transformers is an optional dependency of the bridge
        print(f"  (DiffusionGemma section skipped: {e})")
        return None
    top = material.table["top mass"]
    return Section(title=material.title, text=material.note, images=[(material.png, "received attention per step")],
                   table=material.table, table_caption="one row per denoising step (random weights)",
                   finding=f"The bridge ran {len(material.table)} denoising steps of transformers' own "
                           f"DiffusionGemma with step-bound reducers; the largest per-step key mass ranged "
                           f"{top.min():.3f}-{top.max():.3f} (random weights: a machinery check, not a finding).")


def views_section(model: HookedMDM) -> Section:
    item = D.make_dataset(1, seed=DATA_SEED, n_distractors=4)[0]
    gen = int(model.cfg.extra.get("gen_length", 4))
    run = model.generate(torch.tensor(ZT.encode(item.prompt)), steps=gen, gen_length=gen,
                         record=[ReceivedAttention()], cache="blocks.0.attn.hook_pattern" @ steps(0, -1))
    html = [circuits.attention(run, 0, 0, model), circuits.attention(run, -1, 0, model)]
    drift = R.drift_from_output(run, layer=0)
    labels = model.to_str_tokens(run.tokens[0])
    html.append(circuits.tokens_by_persistence(labels, drift.persistence[0].numpy()))
    top = int(drift.modal_anchor[0])
    text = ("Layer 0 attention of the MDM at the first and the last denoising step ([MASK] = still masked) on the "
            "sweep's first item, and its final tokens coloured by anchor persistence across steps. Rendered from the "
            "circuitsvis bundle inlined in this page: no network needed.")
    finding = (f"Measured: the most persistent layer-0 anchor is position {top} ({labels[top]!r}), an anchor at "
               f"{100 * float(drift.stability[0]):.0f}% of the {gen} steps." if top >= 0 else
               "Measured: no layer-0 anchor was detected at any step of this run.")
    return Section("Interactive attention (circuitsvis)", text, html=html, finding=finding)


def run_demo(out: str = "mdm_lens_report", quick: bool = False, n: int | None = None) -> Path:
    """Write the report to ``out`` and return its index.html. ``n`` = items per twin (default 64, ``quick`` 12);
    the knockout sweep takes n // 8 (at least 2). The sweeps live in ``out/sweeps`` (rerun
    ``mdm-lens report out/sweeps`` to redraw), the data in ``out/data/items.jsonl``."""
    folder = Path(out)
    n = n or (12 if quick else 64)
    torch.manual_seed(0)
    p = _Progress(4)
    twins = p.stage("loading the twins", load_twins)
    data = folder / "data" / "items.jsonl"
    jsonl.export(data, n, seed=DATA_SEED, n_distractors=4)
    p.stage(f"sweeping both twins ({n} items)", lambda: sweep_twins(twins, data, folder / "sweeps", n, max(2, n // 8)))
    extra = p.stage("demo-only sections", lambda: [s for s in (shipped_evaluation_section(twins, folder / "figures"),
                                                               views_section(twins["MDM"]),
                                                               diffusion_gemma_section(folder / "figures"))
                                                    if s is not None])
    index = p.stage("report", lambda: report(folder / "sweeps", out=folder, extra=extra,
                                             title="mdm_lens demo: attention floating in the tiny twins",
                                             meta={"models": ", ".join(TWINS.values()), "items per twin": n}))
    print(f"report: {index.resolve()}  ({p.elapsed:.0f}s)")
    return index
