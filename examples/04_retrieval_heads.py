"""04 — Retrieval heads (spec §3.7): copy@commit / copy@final / evidence_focus on the MDM, Wu's protocol
on the ARM, and the causal check (mask the top-K heads vs K random heads).

    python examples/04_retrieval_heads.py [--n 16] [--k 2]
"""

import argparse
import time

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes import retrieval as RT
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 2)


def show(res: RT.RetrievalScores) -> None:
    grid = res.to_frame().pivot(index="layer", columns="head", values="score")
    frac = float((res.scores > res.threshold).float().mean()) if res.n_counted else float("nan")
    label = "retrieval heads" if res.method != "evidence_focus" else "heads above 0.1 (lax, not a retrieval score)"
    print(f"\n-- {res.method}: counted {res.n_counted}/{len(res.correct)} correct samples; "
          f"{frac:.0%} of heads > {res.threshold}; {label}: {res.above_threshold[:6]}")
    print(grid)


def main(n: int, k: int) -> None:
    items = [RT.from_qa_item(it, ZT.load_tokenizer()) for it in D.make_dataset(n, seed=1234, n_distractors=4)]
    for name, methods in (("mdm-lens/tiny-mdm", ("copy@commit", "copy@final", "evidence_focus")),
                          ("mdm-lens/tiny-arm", ("wu", "evidence_focus"))):
        model = load(name)
        print(f"\n== {model.cfg.model_name} ==")
        scores = {m: RT.retrieval_scores(model, items, method=m) for m in methods}
        for res in scores.values():
            show(res)
        ab = RT.ablation_accuracy(model, items, scores[methods[0]], k=k, n_random=2, seed=0)
        print(f"\n-- causal check (zero hook_z), K={k}: drop top-K {ab.drop_top:+.2f}, drop random {ab.drop_random:+.2f}")
        print(ab.to_frame())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--k", type=int, default=2)
    t0 = time.time()
    a = ap.parse_args()
    main(a.n, a.k)
    print(f"\n[{time.time() - t0:.1f} s]")
