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

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def load(name: str) -> HookedMDM:
    """The zoo twin if it is installed, else a random tiny model of the same interface (with a notice)."""
    try:
        return HookedMDM.from_pretrained(name)
    except MDMLensError as e:
        print(f"[notice] {name} is not available ({type(e).__name__}); using a RANDOM tiny model instead — "
              "numbers below are not the trained twin's.")
        cfg = MDMConfig(d_model=64, n_layers=4, n_heads=4, d_mlp=128, d_vocab=ZT.vocab_size(), n_ctx=128,
                        mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID, eos_token_id=ZT.EOS_ID,
                        pad_token_id=ZT.PAD_ID, attention="causal" if name.endswith("arm") else "bidirectional",
                        model_name=f"random:{name}", extra={"gen_length": 4})
        return HookedMDM.from_config(cfg, seed=0, init_std=0.2)
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
