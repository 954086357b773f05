"""06 — Are anchors necessary?  Attention knockout (anchors vs random keys) and activation patching of
anchor positions with a counterfactual evidence word (symmetric token replacement), MDM vs ARM.

    python examples/06_anchor_knockout.py [--n 8]
"""

import argparse
import random
import time

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes import patching as PT
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def counterfactual(item: D.QAItem, rng: random.Random) -> tuple[str, str]:
    """The prompt with the evidence word replaced by another word of the same pool (same token count)."""
    pool = D.POOLS[D.RELATIONS[item.relation].object]
    other = rng.choice([w for w in pool if w != item.answer and w not in item.prompt.split()])
    s, e = item.evidence_span
    return item.prompt[:s] + other + item.prompt[e:], other


def main(n: int) -> None:
    items = D.make_dataset(n, seed=1234, n_distractors=2)
    rng = random.Random(0)
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        ko_rows, pa_rows = [], []
        for i, it in enumerate(items):
            ids = torch.tensor(ZT.encode(it.prompt))
            res = PT.knockout(model, ids, queries="masked", n_random=2, seed=i, answer=it.answer)
            ko_rows.append(res.table().assign(item=i))
            text, other = counterfactual(it, rng)
            cids = torch.tensor(ZT.encode(text))
            out = model.generate(ids[None], steps=4, gen_length=4)
            step = int(out.trajectory.commit_step[0, len(ids)])            # the step that commits the answer slot
            answer_id, other_id = ZT.encode(it.answer)[0], ZT.encode(other)[0]
            pr = PT.patch_anchor_activations(model, ids, cids, step=step, tokens=(answer_id, other_id), seed=i)
            pa_rows.append(pr.to_frame(metrics=["normalised", "n_positions"]).assign(item=i))
        ko = pd.concat(ko_rows).groupby(level=0).mean().drop(columns="item").loc[["clean", "anchors", "random"]]
        pa = pd.concat(pa_rows).pivot_table(index="layer", columns=["metric", "condition"], values="value")
        print(f"\n== {model.cfg.model_name}: knockout at all layers and steps, masked queries ({n} prompts) ==")
        print(ko)
        print(f"\n== {model.cfg.model_name}: noising patch of resid_pre at the answer's commit step; "
              "normalised LD (1 = no effect, 0 = corrupted) ==")
        print(pa)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    t0 = time.time()
    main(ap.parse_args().n)
    print(f"\n[{time.time() - t0:.1f} s]")
