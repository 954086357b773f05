"""11 — Example 10 with SAELens' own training runner: a TopK SAE per band of denoising steps, trained by
`LanguageModelSAETrainingRunner` on `mdm_lens.sae.MaskedCanvas` (`override_model=`), then the same anchor
analysis on the twin's sampled trajectories.

The runner never sees a sampler trajectory: it streams clean text through the canvas, which masks each token
with a per-row rate (LLaDA's forward process). A band of steps is mapped to a band of mask rates: with one
commit per step and G answer tokens, the canvas before step s has (G - s) / G of the answer still masked, so
steps [s_lo, s_hi] train on rates t ~ U((G - s_hi) / G, (G - s_lo) / G) -- early steps on heavily masked text,
late steps on nearly clean text. (An approximation: the canvas masks the prompt at that rate too, as in
training, while at inference the prompt is always clean.) The text is the twin's own training format
(prompt + answer + <eos> padding to the canvas, `zoo.batches.encode_training_item`), all of one length so no
padding enters the attention; `positions="all"` and `exclude_special_tokens=False` keep the <eos> and marker
rows, where anchors live.

Needs sae-lens and `datasets` (the transformer-lens 3.x venv):

    python examples/11_sae_lens_runner.py   # with sae-lens installed: pip install "mdm-lens[sae]" [--n 24] [--steps 8] [--bands 3] [--tokens 30000]
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import Counter

import torch

from mdm_lens.sae import MaskedCanvas
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from mdm_lens.zoo.batches import encode_training_item
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

ex10 = importlib.import_module("10_sae_steps")  # trajectories, anchor_latents, transfer, bands_of


def band_rates(band: list[int], n_steps: int):
    """The MaskedCanvas `mask_rate` callable of a band of steps: t ~ U(lo, hi) per row (see the docstring)."""
    lo, hi = (n_steps - band[-1]) / n_steps, (n_steps - band[0]) / n_steps

    def draw(batch: int, generator: torch.Generator) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(batch, generator=generator)

    draw.range = (lo, hi)
    return draw


def training_text(n: int, gen_length: int, seed: int = 11) -> list[list[int]]:
    """`n` sequences in the twin's training format, all of the most common length (no padding needed)."""
    rows = [encode_training_item(it, gen_length)[0]
            for it in D.make_dataset(4 * n, seed=seed, n_distractors=4) if len(ZT.encode(it.answer)) < gen_length]
    width = Counter(len(r) for r in rows).most_common(1)[0][0]
    same = [r for r in rows if len(r) == width]
    return same[:n]


def train_band(model, rows: list[list[int]], band: list[int], n_steps: int, layer: int, d_sae: int, k: int,
               tokens: int, seed: int):
    import datasets
    from sae_lens import (LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig,
                          TopKTrainingSAEConfig)

    rates = band_rates(band, n_steps)
    canvas = MaskedCanvas(model, mask_rate=rates, positions="all", seed=seed)
    width = len(rows[0])
    cfg = LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(d_in=model.cfg.d_model, d_sae=d_sae, k=k),
        model_name=model.cfg.model_name, hook_name=f"blocks.{layer}.hook_resid_post", dataset_path="unused",
        is_dataset_tokenized=True, context_size=width, training_tokens=tokens, train_batch_size_tokens=256,
        store_batch_size_prompts=16, n_batches_in_buffer=16, device="cpu", act_store_device="cpu",
        logger=LoggingConfig(log_to_wandb=False), output_path=None, n_eval_batches=0,
        exclude_special_tokens=False, lr=1e-3, streaming=False, seed=seed)
    torch.manual_seed(seed)
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    sae = LanguageModelSAETrainingRunner(cfg, override_dataset=ds, override_model=canvas).run()
    return sae, rates.range


def main(n: int = 24, n_steps: int = 8, n_bands: int = 3, d_sae: int = 256, k: int = 8, tokens: int = 30_000,
         n_text: int = 400, seed: int = 0) -> dict:
    t0 = time.time()
    model = load("mdm-lens/tiny-mdm")
    layer = 2
    rows, n_steps = ex10.trajectories(model, n, n_steps, layer)
    text = training_text(n_text, model.cfg.extra.get("gen_length", 4))
    print(f"{len(rows.step)} trajectory rows from {n} prompts x {n_steps} steps; runner text: {len(text)} sequences "
          f"of {len(text[0])} tokens ({time.time() - t0:.1f}s)")
    saes, best, parts, results = [], [], [], {}
    for b, band in enumerate(ex10.bands_of(n_steps, n_bands)):
        sae, (lo, hi) = train_band(model, text, band, n_steps, layer, d_sae, k, tokens, seed + b)
        sel = torch.isin(rows.step, torch.tensor(band))
        part = ex10.Rows(rows.acts[sel], rows.anchor[sel], [t for t, s in zip(rows.token, sel.tolist()) if s],
                         rows.step[sel])
        table, stats = ex10.anchor_latents(sae, part, scale=1.0)
        print(f"\n== band {b}: steps {band}, runner mask rates U({lo:.3f}, {hi:.3f}) — {stats['anchors']} anchors in "
              f"{stats['rows']} rows; FVU on the trajectory rows {stats['fvu']:.3f}, L0 {stats['l0']:.1f}, dead "
              f"{stats['dead']} ==")
        print(table.to_string(index=False))
        saes.append(sae)
        parts.append(part)
        best.append(int(table.latent[0]))
        results[b] = dict(steps=band, rates=(lo, hi), table=table, **stats)
    overlap = ex10.transfer(saes, best, parts, scale=1.0)
    print("\n== each band's top anchor latent on every band's rows: rate on anchors / elsewhere ==")
    print(overlap)
    print(f"\ndone in {time.time() - t0:.1f}s")
    return dict(bands=results, overlap=overlap)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bands", type=int, default=3)
    ap.add_argument("--d-sae", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=30_000)
    a = ap.parse_args()
    # a tiny model: thousands of small ops, for which a thread pool only adds barriers (on a busy 2-core CPU,
    # one thread ran example 10 in 16 s where two took 190 s)
    torch.set_num_threads(1)
    main(a.n, a.steps, a.bands, a.d_sae, a.k, a.tokens)
