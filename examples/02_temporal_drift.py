"""02 — Anchor drift across denoising steps (MDM) and decode steps (ARM), per layer (spec §3.4–3.5).

Each prompt is generated with a `ReceivedAttention` reducer (query set: all rows); the zscore anchors of
the head-mean received attention at every step go through `floating.drift` (persistence, Jaccard
turnover, distinct anchors, centroid slope) and the §3.5 fixed-sink / floating labels.

    python examples/02_temporal_drift.py [--n 16] [--gen 4]
"""

import argparse
import time
from collections import Counter

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention
from mdm_lens.errors import MDMLensError
from mdm_lens.probes import floating
from mdm_lens.probes.run import anchors_over_steps, drift_from_output
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def layer_rows(model: HookedMDM, prompts: list, gen: int) -> pd.DataFrame:
    rows = []
    for i, p in enumerate(prompts):
        out = model.generate(p[None], steps=gen, gen_length=gen, record=[ReceivedAttention()])
        for layer in range(model.cfg.n_layers):
            d = drift_from_output(out, layer=layer)
            sa = anchors_over_steps(out, layer=layer)
            init = floating.initial_absorption(torch.nan_to_num(sa.received))
            label = floating.classify_layer(d, init).labels[0]
            rows.append(dict(item=i, layer=layer, mean_jaccard=float(d.mean_jaccard[0]),
                             n_distinct=int(d.n_distinct[0]), stability=float(d.stability[0]),
                             empty_fraction=float(d.empty_fraction[0]), centroid_slope=float(d.centroid_slope[0]),
                             top1_change=float(d.top1_change_rate[0]), label=label))
    return pd.DataFrame(rows)


def main(n: int, gen: int) -> None:
    items = D.make_dataset(n, seed=1234, n_distractors=4)
    prompts = [torch.tensor(ZT.encode(it.prompt)) for it in items]
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        df = layer_rows(model, prompts, gen)
        agg = df.groupby("layer").agg(mean_jaccard=("mean_jaccard", "mean"), n_distinct=("n_distinct", "mean"),
                                      stability=("stability", "mean"), empty=("empty_fraction", "mean"),
                                      slope=("centroid_slope", "mean"), top1_change=("top1_change", "mean"))
        agg["majority_label"] = df.groupby("layer").label.agg(lambda s: Counter(s).most_common(1)[0][0])
        agg["labels"] = df.groupby("layer").label.agg(lambda s: dict(Counter(s)))
        print(f"\n== {model.cfg.model_name}: drift over {gen} steps, mean over {n} prompts ==")
        print(agg)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--gen", type=int, default=4)
    t0 = time.time()
    a = ap.parse_args()
    main(a.n, a.gen)
    print(f"\n[{time.time() - t0:.1f} s]")
