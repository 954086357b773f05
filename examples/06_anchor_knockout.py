"""06 — Are anchors necessary, and does knocking them out change the answer?  Attention knockout (anchors vs
random keys, answer-level metrics) and activation patching of anchor positions with a counterfactual
evidence word (symmetric token replacement) in both directions, MDM vs ARM; then the same pair of canvases
through `transformer_lens.patching`.

    python examples/06_anchor_knockout.py [--n 8] [--steps 0 1]
"""

import argparse
import random
import time

import pandas as pd
import torch
from transformer_lens import patching as tl_patching

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


def main(n: int, steps: list[int] | None) -> None:
    items = D.make_dataset(n, seed=1234, n_distractors=2)
    rng = random.Random(0)
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        ko_rows, pa_rows = [], []
        for i, it in enumerate(items):
            ids = torch.tensor(ZT.encode(it.prompt))
            # default metric: the gold answer's log-prob at the end of a generation run with the knockout
            res = PT.knockout(model, ids, steps=steps, queries="masked", n_random=2, seed=i, answer=it.answer)
            ko_rows.append(res.table().assign(item=i))
            text, other = counterfactual(it, rng)
            cids = torch.tensor(ZT.encode(text))
            out = model.generate(ids[None], steps=4, gen_length=4)
            step = int(out.trajectory.commit_step[0, len(ids)])            # the step that commits the answer slot
            answer_id, other_id = ZT.encode(it.answer)[0], ZT.encode(other)[0]
            for direction in PT.DIRECTIONS:
                pr = PT.patch_anchor_activations(model, ids, cids, step=step, tokens=(answer_id, other_id), seed=i,
                                                 direction=direction)
                pa_rows.append(pr.to_frame(metrics=["normalised"]).assign(item=i, direction=direction))
        ko = pd.concat(ko_rows).groupby(level=0).mean().drop(columns="item").loc[["clean", "anchors", "random"]]
        pa = pd.concat(pa_rows).pivot_table(index="layer", columns=["direction", "condition"], values="value")
        where = "all steps" if steps is None else f"steps {steps}"
        print(f"\n== {model.cfg.model_name}: knockout at all layers, {where}, masked queries ({n} prompts) ==")
        print("value/effect = sampled log-prob of the gold answer (and its change); tf_* = teacher-forced; "
              "metric_mean = margin at the positions each step commits")
        print(ko)
        print(f"\n== {model.cfg.model_name}: patching resid_pre at the answer's commit step, normalised LD ==")
        print("noising (corrupt -> clean run): 1 = not necessary, 0 = as bad as corrupted; "
              "denoising (clean -> corrupt run): 1 = sufficient to restore, 0 = no recovery")
        print(pa)
        # the same matched canvases through TransformerLens' own patching (denoising, per layer x position)
        it = items[0]
        ids, cids = torch.tensor(ZT.encode(it.prompt)), torch.tensor(ZT.encode(counterfactual(it, rng)[0]))
        out = model.generate(ids[None], steps=4, gen_length=4)
        s = int(out.trajectory.commit_step[0, len(ids)])
        pair = PT.matched_canvases(out, cids, step=s, model=model)
        row = len(ids) - int(out.causal or model.cfg.logit_shift)             # readout row of the answer slot
        a = ZT.encode(it.answer)[0]
        _, cache = model.run_with_cache(pair.clean)
        grid = tl_patching.get_act_patch_resid_pre(model, pair.corrupted, cache,
                                                   lambda logits: logits[0, row].log_softmax(-1)[a])
        top = grid.flatten().argsort(descending=True)[:3]
        print(f"\n   TL get_act_patch_resid_pre on matched canvases (item 0, step {s}): top (layer, pos) = "
              f"{[(int(t) // grid.shape[1], int(t) % grid.shape[1]) for t in top]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--steps", type=int, nargs="*", default=None, help="denoising steps to knock out (default all)")
    t0 = time.time()
    args = ap.parse_args()
    main(args.n, args.steps)
    print(f"\n[{time.time() - t0:.1f} s]")
