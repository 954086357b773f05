"""Lenses over denoising steps: the logit lens and a tuned lens per (layer × step) of one trajectory, and answer
emergence (the first step from which a layer's top-1 is the final token and stays so).

    out = model.generate(prompt, steps=16, gen_length=16)
    trace = lens_trace(model, out)                         # logit lens; lens=TunedLens for the tuned one
    answer_emergence(trace)                                # tidy rows (batch, layer, position, emergence_step, ...)
    lens = train_tuned_lens(model, clean_tokens, seed=0)   # KL(final || lens) on masked canvases
"""

from mdm_lens.lens.emergence import answer_emergence, emergence_steps
from mdm_lens.lens.logit import LensTrace, lens_logits, lens_trace
from mdm_lens.lens.tuned import TunedLens, masked_kl, train_tuned_lens

__all__ = ["lens_logits", "lens_trace", "LensTrace", "TunedLens", "train_tuned_lens", "masked_kl",
           "answer_emergence", "emergence_steps"]
