"""Samplers whose forwards are not all whole-canvas denoising steps, and which of their forwards are.

Nemotron-Labs-Diffusion (`sampler="nemotron"`) and BD3LM (`sampler="bd3lm"`) run forwards that a replay does not
rebuild (`Sampler.no_replay`): every forward computes a window of rows against a KV cache or a block-causal
prefix, and some forwards are no denoising step at all. What the probes that read these runs from the run itself
(knockout, the lens over steps) call a *denoising forward*:

* nemotron: the forwards of kind ``"denoise"`` (a block's rows over [cache; block]); not the causal ``"prefill"``
  over the prompt nor the causal ``"commit"`` after each block (they fill the KV cache and seed the next block's
  first token from their last logit);
* bd3lm: the forwards that compute p(x0) of a block holding masks; not the storing forward of a finished block
  (``kv_cache=True``: ``state.extra["kv_store"]``, it commits nothing). A BD3LM step that reuses p(x0) (nothing
  changed at the previous step) runs no forward at all.

Knockout's step ``k`` on these samplers is the k-th denoising forward of the run (counted in run order), and its
grid has :func:`max_denoising_forwards` entries; the lens keeps the run's own step indices and reads NaN at steps
that are no denoising forward (:func:`step_notes` says why).
"""

from __future__ import annotations

from typing import Any

OWN_FORWARDS = {
    "nemotron": "a causal prefill over the prompt and a causal commit forward after each block are no denoising "
                "step; step k = the k-th 'denoise' forward (a block's rows against the KV cache)",
    "bd3lm": "each step forwards one block against the stored blocks (a window under the block-causal mask, or the "
             "block against its KV cache) and kv_cache=True adds a storing forward per finished block, which is no "
             "denoising step; step k = the k-th forward that computes p(x0) of a block",
}


def runs_own_forwards(sampler: str) -> bool:
    return sampler in OWN_FORWARDS


def is_denoising_forward(state: Any) -> bool:
    """During a run of one of `OWN_FORWARDS`: whether the forward now running (`model.state`) is a denoising step."""
    if state is None or state.phase != "cond":
        return False
    return state.extra.get("kind", "denoise") == "denoise" and not state.extra.get("kv_store", False)


def max_denoising_forwards(sampler: str, settings: dict, prompt_length: int) -> int:
    """The most denoising forwards a run can have (knockout's step grid). nemotron: `block_length` per block, i.e.
    `gen_length` (a block's first slot is the seed, so a run usually has one fewer per block); bd3lm: `steps` per
    block holding a generated position."""
    g = int(settings["gen_length"])
    if sampler == "nemotron":
        return g
    bs, total = int(settings["block_size"]), prompt_length + g
    return (-(-total // bs) - prompt_length // bs) * int(settings["steps"])


def step_notes(out: Any) -> dict[int, str]:
    """Run steps of `out` (a run of one of `OWN_FORWARDS`) that are no denoising forward → why; the other steps are
    denoising forwards. nemotron reads the kind its trajectory kept; bd3lm tells a storing forward by its block
    holding no mask in the step's input (a denoising step always has one: the block ends when none is left)."""
    notes: dict[int, str] = {}
    if out.sampler == "nemotron":
        for s, f in enumerate(out.trajectory.forwards or []):
            kind = f["extra"].get("kind")
            if kind != "denoise":
                notes[s] = (f"step {s} is Nemotron's causal {kind} forward (it fills the KV cache and seeds a block's "
                            "first token), no denoising step")
        return notes
    bs, mask_id = int(out.settings["block_size"]), out.settings["mask_id"]
    x = out.trajectory.x_steps
    for s in range(x.shape[0]):
        lo = int(out.trajectory.block_of_step[s]) * bs
        if not bool((x[s][:, lo:lo + bs] == mask_id).any()):
            notes[s] = f"step {s} is BD3LM's storing forward of block {lo // bs} (kv_cache), no denoising step"
    return notes
