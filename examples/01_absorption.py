"""01 — Absorption by layer, MDM vs ARM twin, in the paper's mode and in the default (symmetric) mode.

Paper mode (AF reference): head-mean attention of one clean forward on the final sequence; MDM = top-1
share (Rule A always falls back to top-1), ARM = column 0.  Default mode: pos0 / top1 / anchors (zscore)
for both models, each with its uniform null and the excess over it.

    python examples/01_absorption.py [--n 32]
"""

import argparse
import time

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes.run import absorption_by_layer, generate_final
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 2)


def main(n: int) -> None:
    torch.manual_seed(0)
    items = D.make_dataset(n, seed=1234, n_distractors=4)
    prompts = [torch.tensor(ZT.encode(it.prompt)) for it in items]
    summary = {}
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        toks, am, _ = generate_final(model, prompts)
        for mode in ("paper", "default"):
            res = absorption_by_layer(model, toks, attention_mask=am, mode=mode)
            print(f"\n== {model.cfg.model_name} · {mode} mode (percent; mean over {n} samples) ==")
            print(res.table())
            summary[(name.split("-")[-1], mode)] = res
    mdm_p, arm_p = summary[("mdm", "paper")].table(), summary[("arm", "paper")].table()
    mdm_d, arm_d = summary[("mdm", "default")].table(), summary[("arm", "default")].table()
    cmp = pd.DataFrame({"MDM paper(top1)": mdm_p["top1"], "ARM paper(pos0)": arm_p["pos0"],
                        "MDM pos0": mdm_d["pos0"], "ARM top1": arm_d["top1"],
                        "MDM anchors": mdm_d["anchors"], "ARM anchors": arm_d["anchors"],
                        "MDM top1 excess": mdm_d["top1_excess"], "ARM pos0 excess": arm_d["pos0_excess"]})
    print("\n== MDM vs ARM, both modes ==")
    print(cmp)
    print("\nwhere the modes disagree (|paper − default anchors| > 5 pts):")
    for tag, p, d, col in (("MDM", mdm_p, mdm_d, "top1"), ("ARM", arm_p, arm_d, "pos0")):
        gap = (p[col] - d["anchors"]).abs()
        layers = [int(l) for l in gap.index[gap > 5]]
        print(f"  {tag}: paper {col} vs zscore anchors differ at layers {layers or 'none'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    t0 = time.time()
    main(ap.parse_args().n)
    print(f"\n[{time.time() - t0:.1f} s]")
