"""03 — Norm vs angle split of the anchor key's QK advantage, per layer (spec §3.6).

One clean forward on each final sequence (prompt + generated answer); the anchor is the top-1
received key of each layer (head mean); Δ = N + G per head, then averaged over heads and prompts.

    python examples/03_qk_decomposition.py [--n 16]
"""

import argparse
import time
from collections import Counter

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes.run import generate_final, qk_at_layer
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def main(n: int) -> None:
    items = D.make_dataset(n, seed=1234, n_distractors=4)
    prompts = [torch.tensor(ZT.encode(it.prompt)) for it in items]
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        toks, am, _ = generate_final(model, prompts)
        rows = []
        for layer in range(model.cfg.n_layers):
            res = qk_at_layer(model, toks, layer, attention_mask=am)
            df = res.to_frame()
            wide = df[df.metric.isin(["norm_term", "angle_term", "advantage", "key_norm_ratio", "cos_gap",
                                      "value_norm_ratio"])].groupby("metric").value.mean()
            rows.append(dict(layer=layer, anchor_pos_median=float(res.anchor[:, 0].float().median()), **wide,
                             head_mean_label=Counter(res.labels_mean.tolist()).most_common(1)[0][0],
                             per_head_labels=dict(Counter(res.labels.flatten().tolist()))))
        print(f"\n== {model.cfg.model_name}: QK advantage of the top-1 anchor (logits), mean over heads × {n} ==")
        print(pd.DataFrame(rows).set_index("layer"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    t0 = time.time()
    main(ap.parse_args().n)
    print(f"\n[{time.time() - t0:.1f} s]")
