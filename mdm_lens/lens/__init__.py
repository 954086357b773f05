"""Lenses and probes over denoising steps: the logit lens and a tuned lens per (layer × step) of one trajectory,
answer emergence (the first step from which a layer's top-1 is the final token and stays so), and linear probes per
(layer × step) on recorded activations (`linear`).

    out = model.generate(prompt, steps=16, gen_length=16)
    trace = lens_trace(model, out)                         # logit lens; lens=TunedLens for the tuned one
    answer_emergence(trace)                                # tidy rows (batch, layer, position, emergence_step, ...)
    lens = train_tuned_lens(model, clean_tokens, seed=0)   # KL(final || lens) on masked canvases
    probe_grid(features_from_cache(out.cache, hook=...), target)   # AUC / R² per (layer, step) with CIs
"""

from mdm_lens.lens.emergence import answer_emergence, emergence_steps
from mdm_lens.lens.linear import (COLUMNS, POOLED, POOLS, PROBES, ProbeFeatures, auc, features_from_cache,
                                  fit_logistic, fit_ridge, item_split, probe_grid, r2)
from mdm_lens.lens.logit import LensTrace, lens_logits
from mdm_lens.lens.trace import lens_trace
from mdm_lens.lens.tuned import TunedLens, masked_kl, train_tuned_lens

__all__ = ["lens_logits", "lens_trace", "LensTrace", "TunedLens", "train_tuned_lens", "masked_kl",
           "answer_emergence", "emergence_steps",
           "ProbeFeatures", "features_from_cache", "item_split", "auc", "r2", "fit_logistic", "fit_ridge",
           "probe_grid", "POOLS", "PROBES", "POOLED", "COLUMNS"]
