"""SAELens on masked diffusion LMs: train on the activations an MDM is trained on, splice SAEs into
denoising steps, and score them with the diffusion loss.

    canvas = MaskedCanvas(model, positions="masked", seed=0)          # SAELens' override_model=
    model.generate(p, fwd_hooks=[sae_hook(sae, "blocks.1.hook_resid_post") @ steps(0, -1)])
    diffusion_ce_score(model, sae, "blocks.1.hook_resid_post", tokens, mask_rates=(0.5,), seeds=(0,))
    export_activations(model, "items.jsonl", "blocks.1.hook_resid_post", steps=steps(0, -1), out="acts/")

`sae_hook` and `diffusion_ce_score` take any object with SAELens' `SAE` surface (`encode`, `decode`,
`W_dec`, `hooks()`), so they need sae-lens only through the SAE you pass; `MaskedCanvas` needs nothing from it.
"""

from mdm_lens.sae.canvas import MaskedCanvas
from mdm_lens.sae.splice import SAEHook, sae_hook
from mdm_lens.sae.score import diffusion_ce_score
from mdm_lens.sae.export import export_activations

__all__ = ["MaskedCanvas", "SAEHook", "sae_hook", "diffusion_ce_score", "export_activations"]
