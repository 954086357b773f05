"""05 — Region-level attention flow from the answer to the documents, gold moved over positions (§3.8).

Default: token-level rollout, pooled onto regions from one tokenisation (answer row, density-normalised
shares, gold ratio).  Paper: the AF region rollout on AF-style boundaries (off by one after BOS).

    python examples/05_region_flow.py [--n 12]
"""

import argparse
import time

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes.run import flow_for_items
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def main(n: int) -> None:
    rows = []
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        for pos in ("first", "middle", "last"):
            items = D.make_dataset(n, seed=1234, n_distractors=4, gold_position=pos)
            for mode in ("default", "paper"):
                res = flow_for_items(model, items, mode=mode)
                df = res.to_frame()
                ans = df[df.metric == "answer_row"].groupby("kind").value.sum() / n
                rows.append(dict(model=model.cfg.model_name, gold=pos, mode=mode,
                                 gold_ratio=float(res.gold_ratio.nanmean()),
                                 gold_ratio_density=float(res.gold_ratio_density.nanmean()),
                                 answer_to_gold=float(ans.get("gold", float("nan"))),
                                 answer_to_docs=float(ans.get("doc", float("nan"))),
                                 answer_to_bos=float(ans.get("bos", float("nan"))),
                                 row_spread=float(df[df.metric == "row_spread"].value.mean()),
                                 acc=float(res.correct.float().mean())))
    print("\n== answer-row flow (mean over items); gold ratio = F(A,gold) / mean F(A,distractor) ==")
    print(pd.DataFrame(rows).set_index(["model", "gold", "mode"]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    t0 = time.time()
    main(ap.parse_args().n)
    print(f"\n[{time.time() - t0:.1f} s]")
