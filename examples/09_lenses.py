"""09 — Lenses over denoising steps: the logit lens and a tuned lens at every (layer, step) of the twin's runs, and
answer emergence (the first step from which a layer's top-1 is the final token and stays so until it is decoded).

A batch of held-out zoo questions is generated with the LLaDA sampler; `lens_trace` replays each step and reduces
every layer to top-1 / final-token probability / rank (no `[step, layer, pos, vocab]` tensor is kept). A tuned lens
is trained on masked canvases of other zoo items (KL to the final logits) and compared on held-out canvases.

The default canvas is the twin's own (4 tokens: the answer word, then <eos>); a longer `--gen` takes the twin
outside what it was trained on.

    python examples/09_lenses.py [--n 16] [--gen 4] [--tune-steps 60] [--out out/09_lenses]
"""

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from mdm_lens.lens import answer_emergence, lens_trace, masked_kl, train_tuned_lens
from mdm_lens.views.fig_lens import emergence_map, lens_heatmap
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from mdm_lens.zoo.batches import collate, encode_training_item
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), ZT.PAD_ID, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], am[i, width - len(p):] = torch.tensor(p), 1
    return ids, am


def sequences(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = collate([encode_training_item(it, 4) for it in D.make_dataset(n, seed=seed, n_distractors=2)])
    return b.ids, b.attention_mask


def main(n: int, gen: int, tune_steps: int, out_dir: Path) -> None:
    model = load("mdm-lens/tiny-mdm")
    items = D.make_dataset(n, seed=4321, n_distractors=2)
    ids, am = left_padded([ZT.encode(it.prompt) for it in items])
    out = model.generate(ids, attention_mask=am, gen_length=gen, steps=gen, seed=0)
    print(out, "\n")

    logit = lens_trace(model, out)
    print(logit)
    em = answer_emergence(logit)
    row0 = em[em.batch == 0].pivot(index="layer", columns="position", values="emergence_step")
    print(f"\n== item 0: {items[0].question!r} -> {out.texts[0]!r} (gold {items[0].answer!r})")
    print("emergence step (logit lens; rows = layers, columns = answer positions):")
    print(row0.to_string())
    print("commit steps:", logit.commit_step[0].tolist())
    per_layer = em.groupby("layer").agg(emerged=("emergence_step", lambda s: s.notna().mean()),
                                        mean_lead=("lead", "mean"))
    print(f"\n== all {n} items: share of (item, position) whose top-1 emerges by the commit, mean lead (steps)")
    print(per_layer)
    stop = torch.isin(out.generated, torch.tensor([ZT.EOS_ID, ZT.PAD_ID])).long().cumsum(-1) == 0   # answer tokens
    words = em[stop[em.batch.to_numpy(int), em.position.to_numpy(int)].numpy()]
    print(f"\n== the answer's own tokens only ({len(words) // model.cfg.n_layers} of them, before the first <eos>)")
    print(words.groupby("layer").agg(emerged=("emergence_step", lambda s: s.notna().mean()),
                                     mean_lead=("lead", "mean"),
                                     early=("lead", lambda s: (s >= 1).sum() / len(s))))

    train_ids, train_am = sequences(256, seed=1)
    test_ids, test_am = sequences(64, seed=2)
    t0 = time.time()
    tuned_lens = train_tuned_lens(model, train_ids, attention_mask=train_am, n_steps=tune_steps, batch_size=16,
                                  lr=3e-3, seed=0)
    kl_logit = masked_kl(model, test_ids, attention_mask=test_am, seed=7)
    kl_tuned = masked_kl(model, test_ids, attention_mask=test_am, lens=tuned_lens, seed=7)
    print(f"\n== tuned lens ({tune_steps} steps, {time.time() - t0:.1f} s): held-out KL(final || lens) on masked "
          "positions, per layer")
    print(pd.DataFrame({"logit lens": kl_logit.numpy(), "tuned lens": kl_tuned.numpy()}).rename_axis("layer"))

    tuned = lens_trace(model, out, lens=tuned_lens)
    print("\n== top-1 = final token on still-masked positions, mean over steps and items, per layer")
    print(pd.DataFrame({name: t.accuracy("masked").nanmean(-1).nanmean(0).numpy()
                        for name, t in (("logit lens", logit), ("tuned lens", tuned))}).rename_axis("layer"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, trace in (("logit", logit), ("tuned", tuned)):
        grid = trace.accuracy("masked").nanmean(-1).T.numpy()            # [layer, step], mean over items
        lens_heatmap(grid, trace.steps, trace.layers, path=out_dir / f"{name}_lens_heatmap.png",
                     title=f"tiny-mdm, {name} lens: top-1 = final token on still-masked positions ({n} items)",
                     value_label="share of masked positions")
        em = answer_emergence(trace)
        first = em[em.batch == 0].pivot(index="layer", columns="position", values="emergence_step")
        emergence_map(first.astype("Float64").to_numpy(float, na_value=float("nan")), trace.commit_step[0],
                      trace.layers, labels=model.to_str_tokens(out.generated[0]), n_steps=out.n_steps,
                      path=out_dir / f"{name}_emergence_item0.png",
                      title=f"item 0, {name} lens: first step the final token is top-1 (and stays)")
    print(f"\nfigures in {out_dir}/")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--tune-steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("out/09_lenses"))
    t = time.time()
    a = ap.parse_args()
    main(a.n, a.gen, a.tune_steps, a.out)
    print(f"\n[{time.time() - t:.1f} s]")
