"""Patching the noise-level conditioning of a time-conditioned diffusion LM (Duo; MDLM with `time_conditioning`):
run step k's forward (its canvas, its state, its step hooks) with the σ of step j.

    logits = patching.sigma_patch(model, out, k, j)      # == model(x_k, sigma=σ_j), under step k's state

The σ is replaced at `hook_sigma`, the first point of the conditioning path, so the timestep embedding, `hook_cond`
and every adaLN modulation downstream are those of σ_j; the tokens and everything else are step k's. The same as a
recipe with the hooks: `out.replay(model, k, fwd_hooks=[("hook_sigma", lambda t, hook: σ_j)])`, or patch
`hook_cond` with a cached `hook_cond` of step j (equal: the conditioning reads nothing but σ)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError


def sigma_patch(model: Any, out: Any, step: int, source_step: int, *, fwd_hooks: Any = (),
                grad: bool = False) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits of step `step`'s forward of run `out` conditioned on step `source_step`'s σ.

    Refused (InputError) on a model that ignores σ (MDLM with `time_conditioning` false zeroes it: the patch would
    change nothing) and on a run whose sampler records no σ per step. `fwd_hooks` are added to the replay (bound to
    steps by `at_steps` like any replay hook); `grad=True` keeps the autograd graph."""
    if hasattr(out, "check_model"):  # another model's run first: its conditioning is not the question
        out.check_model(model)
    if not model.cfg.extra.get("time_conditioning"):
        raise InputError(f"sigma_patch: {model.cfg.model_name} is not time-conditioned (σ is zeroed inside the "
                         "network), so every step's conditioning is the same and the patch changes nothing.",
                         argument="model", value=model.cfg.model_name, allowed="a time-conditioned model (Duo, "
                         "MDLM with time_conditioning=true)")
    n = out.n_steps
    k = validate.index(step, n, name="step", what=f"step of this {n}-step run")
    j = validate.index(source_step, n, name="source_step", what=f"step of this {n}-step run")
    sigma_j = out.state_at(j).extra.get("sigma")
    if sigma_j is None:
        raise ArgumentError(f"sigma_patch: this {out.sampler!r} run records no σ per step.", argument="out",
                            value=out.sampler, allowed="a run of sampler 'mdlm', 'duo', 'bd3lm' or 'gidd'")
    sigma_j = sigma_j.to(model.input_device)

    def to_source(sigma: Tensor, hook: Any) -> Tensor:
        return sigma_j.to(sigma.dtype).expand_as(sigma)

    return out.replay(model, k, fwd_hooks=[("hook_sigma", to_source), *fwd_hooks], grad=grad)


def sigma_of_steps(out: Any) -> Float[Tensor, "step batch"]:
    """σ of every step of a DDiT run (what each step's forward was conditioned on). A run whose sampler sets no
    σ on its steps (LLaDA, Dream, …: their models are not conditioned on the noise level) is refused, as
    `sigma_patch` refuses it."""
    sigmas = [out.state_at(s).extra.get("sigma") for s in range(out.n_steps)]
    if any(sigma is None for sigma in sigmas):
        raise ArgumentError(f"sigma_of_steps: this {out.sampler!r} run records no σ per step (only the DDiT "
                            "samplers condition their forwards on σ).", argument="out", value=out.sampler,
                            allowed="a run of sampler 'mdlm', 'duo', 'bd3lm' or 'gidd'")
    return torch.stack(sigmas)
