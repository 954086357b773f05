"""`sae_hook`: splice a SAELens SAE into a hook point at chosen denoising steps.

    model.generate(p, fwd_hooks=[sae_hook(sae, "blocks.1.hook_resid_post") @ steps(0, -1)])
    sae_hook(sae, name, steer={12: 4.0}) @ steps(0, 3)        # add 4 * W_dec[12] at steps 0..3 only
    sae_hook(sae, name, sae_fwd_hooks=[("hook_sae_acts_post", fn)])   # read / edit the latents

The activation is replaced by the SAE's reconstruction (plus the error term x - decode(encode(x)) with
`use_error_term=True`, computed here, not by the SAE's forward, so any SAE with encode/decode gets it: the splice
is then exact and a latent edit is the only change). Outside `generate` (``model.run_with_hooks(tokens,
fwd_hooks=[sae_hook(sae, name)])``) it fires on every forward; a step-bound one (``@ steps(...)``) is refused
there, having no step to fire at. The SAE's own hook points keep
SAELens' names (`hook_sae_acts_post`, `hook_sae_recons`, `hook_sae_error`, ...): hooks on them are
installed inside TL's `hooks()` context of the SAE for each call, so they are removed even when a run raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.hooks.steps import ALL_STEPS, StepHook, Steps


def _check_sae(sae: Any) -> None:
    """The documented surface mdm_lens uses: `encode`, `decode` and `W_dec` (`[d_sae, d_in]`). `hooks` (TL's
    context manager, SAELens' SAEs have it) is needed only for `sae_fwd_hooks`."""
    for attr in ("encode", "decode", "W_dec"):
        if not hasattr(sae, attr):
            raise ArgumentTypeError(f"sae={validate.describe(sae)} has no {attr!r}: expected a SAELens SAE (or any "
                                    "object with encode, decode and W_dec).", argument="sae", value=sae,
                                    allowed="a sae_lens.SAE (standard, TopK, JumpReLU, ...)")


def _reconstruct(sae: Any, xs: Tensor, sae_fwd_hooks: Sequence[tuple[str, Callable]]) -> Tensor:
    """The SAE's reconstruction of `xs`; through its forward inside TL's `hooks()` context when it has one (so
    SAELens' hook points fire and the latent hooks go even on a raise), with its own error term switched off:
    mdm_lens adds the error term itself, so an SAE whose forward ignores `use_error_term` is spliced the same."""
    if not hasattr(sae, "hooks"):
        if sae_fwd_hooks:
            raise ArgumentTypeError(f"sae_fwd_hooks need an SAE with TL hook points (a `hooks()` context); "
                                    f"{type(sae).__name__} has none.", argument="sae_fwd_hooks",
                                    value=[h[0] for h in sae_fwd_hooks], allowed="() for this SAE")
        return sae.decode(sae.encode(xs))
    previous = getattr(sae, "use_error_term", None)
    with sae.hooks(fwd_hooks=list(sae_fwd_hooks)):
        try:
            if previous is not None:
                sae.use_error_term = False
            return sae(xs)  # SAELens' forward fires hook_sae_input/acts_pre/acts_post/recons/output
        finally:
            if previous is not None:
                sae.use_error_term = previous


def _splice(sae: Any, x: Tensor, use_error_term: bool, steer: dict[int, float],
            sae_fwd_hooks: Sequence[tuple[str, Callable]]) -> Tensor:
    if x.shape[-1] != sae.W_dec.shape[-1]:
        raise InputError(f"the SAE reads d_in={sae.W_dec.shape[-1]} but this hook point is {x.shape[-1]} wide.",
                         argument="sae", value=tuple(sae.W_dec.shape), allowed=f"an SAE with d_in={x.shape[-1]}")
    dtype = x.dtype
    xs = x.to(sae.W_dec.dtype)
    out = _reconstruct(sae, xs, sae_fwd_hooks)
    if use_error_term:
        # x - decode(encode(x)) from the un-hooked SAE: with no edit the splice is exactly x, and a latent edit
        # (sae_fwd_hooks, steer) is the only change -- SAELens' definition, computed here for any SAE
        with torch.no_grad():
            error = xs - sae.decode(sae.encode(xs))
        out = out + error
    if steer:
        idx = torch.tensor(list(steer), device=sae.W_dec.device)
        alpha = torch.tensor(list(steer.values()), dtype=sae.W_dec.dtype, device=sae.W_dec.device)
        out = out + alpha @ sae.W_dec[idx]
    return out.to(dtype)


@dataclass
class SAEHook(StepHook):
    """A `StepHook` whose function splices `sae`; `hook @ steps(...)` binds it to steps (all steps by default)."""

    sae: Any = None
    use_error_term: bool = False
    steer: dict = field(default_factory=dict)
    sae_fwd_hooks: tuple = ()

    def __matmul__(self, when: Steps) -> "SAEHook":
        if not isinstance(when, Steps):
            raise ArgumentTypeError(f"sae_hook(...) @ {validate.describe(when)}: expected steps(...).",
                                    argument="steps", value=when, allowed="mdm_lens.steps(...)")
        return SAEHook(self.name, self.fn, when, self.sae, self.use_error_term, self.steer, self.sae_fwd_hooks)


def sae_hook(sae: Any, hook_name: str, *, use_error_term: bool = False, steer: dict[int, float] | None = None,
             sae_fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> SAEHook:
    """A hook that replaces the activation at `hook_name` by `sae`'s reconstruction (all steps; `@ steps(...)`
    for chosen ones). `steer={latent: alpha}` adds `alpha * W_dec[latent]` to the output; `sae_fwd_hooks` are
    TL hooks on the SAE's own hook points (SAELens' names). Outside `generate` (`run_with_hooks`, `hooks()`) it
    fires on every forward; bound to steps it is refused there (a plain forward has no step)."""
    _check_sae(sae)
    if not isinstance(hook_name, str):
        raise ArgumentTypeError(f"hook_name={validate.describe(hook_name)} must be a hook name.",
                                argument="hook_name", value=hook_name, allowed="a str such as 'blocks.1.hook_resid_post'")
    use_error_term = validate.boolean(use_error_term, name="use_error_term")
    if steer is not None and not isinstance(steer, dict):
        raise ArgumentTypeError(f"steer={validate.describe(steer)} must be a dict {{latent: alpha}} (add alpha * "
                                "W_dec[latent] to the output).", argument="steer", value=steer,
                                allowed="a dict of int latent -> float alpha, or None")
    steer = dict(steer or {})
    d_sae = sae.W_dec.shape[0]
    for i, a in steer.items():
        validate.integer(i, name="steer latent", min=0, max=d_sae - 1)
        validate.number(a, name=f"steer[{i}]")
    sae_fwd_hooks = tuple(sae_fwd_hooks)
    for j, h in enumerate(sae_fwd_hooks):
        if not (isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str) and callable(h[1])):
            raise ArgumentTypeError(f"sae_fwd_hooks[{j}]={validate.describe(h)} must be a (name, fn) pair.",
                                    argument=f"sae_fwd_hooks[{j}]", value=h, allowed="(SAE hook name, callable)")
        if hasattr(sae, "hook_dict") and h[0] not in sae.hook_dict:
            raise InputError(f"the SAE has no hook point {h[0]!r}.", argument=f"sae_fwd_hooks[{j}]", value=h[0],
                             allowed=f"one of {sorted(sae.hook_dict)}")

    def fn(tensor: Tensor, hook: Any = None) -> Tensor:
        return _splice(sae, tensor, use_error_term, steer, sae_fwd_hooks)

    return SAEHook(hook_name, fn, ALL_STEPS, sae, use_error_term, steer, sae_fwd_hooks)
