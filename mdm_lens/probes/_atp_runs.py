"""The forwards attribution patching needs at one denoising step, and the exact patching loop it is checked
against (:mod:`attribution`).  Why a module of its own: the attribution result and its argument checks are one
idea, the hooked forwards (saving activations and their gradients, patching one component or one head) another.

A *side* of a step is one of the two runs being compared: ``"clean"`` (the clean canvas) or ``"corrupt"`` (the
canvas with the corrupted prompt, or the clean canvas under attention knockout).  Every hook lives in a
TransformerLens hook context (``run_with_hooks``), so it is removed when the forward returns or raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens.errors import ArgumentTypeError

from . import _causal as C
from ._knockout_hooks import KnockoutHooks

COMPONENTS = {"resid_pre": "blocks.{l}.hook_resid_pre", "attn_out": "blocks.{l}.hook_attn_out",
              "mlp_out": "blocks.{l}.hook_mlp_out", "z": "blocks.{l}.attn.hook_z"}
HEAD_COMPONENTS = ("z",)      # [batch, pos, head, d_head]: estimates per head (through W_O)
# the first hook point every later activation depends on: made a leaf that needs a gradient, so the
# backward reaches every hooked activation even when the model's parameters are frozen
_ROOT = "blocks.0.hook_resid_pre"


@dataclass
class StepPair:
    """One step's two inputs: the canvases, their mask and forward kwargs (a block run's block length), the
    positions the clean run committed at the step, and the knockout hooks when the corruption is a knockout."""

    clean: Int[Tensor, "batch pos"]
    corrupted: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    forward_kwargs: dict
    committed: Bool[Tensor, "batch total"]
    knockout: KnockoutHooks | None = None
    corrupt_hooks: tuple = ()     # a corruption given as forward hooks on the clean canvas (e.g. embedding noise)

    def tokens(self, side: str) -> Tensor:
        return self.clean if side == "clean" else self.corrupted

    def side_hooks(self, side: str) -> list[tuple[str, Any]]:
        """The corruption's own hooks on the corrupted side (a knockout's, or the caller's); none otherwise."""
        if side == "corrupt" and self.corrupt_hooks:
            return [(n, self.quiet(fn)) for n, fn in self.corrupt_hooks]
        if side == "corrupt" and self.knockout is not None:
            ko = self.knockout
            ko.tokens, ko.attention_mask, ko.forward_kwargs, ko.n_knocked = self.clean, self.attention_mask, \
                self.forward_kwargs, {}
            return ko.hooks()
        return []

    def quiet(self, fn: Callable) -> Callable:
        """``fn`` silenced during the knockout's anchor pre-pass (an unablated re-run inside the forward): the
        activations saved or patched are the knocked-out forward's, and the anchors are the unpatched input's."""
        ko = self.knockout
        if ko is None:
            return fn

        def hook(act: Tensor, hook: Any) -> Any:
            return None if ko._prepass else fn(act, hook)
        return hook


def metric_tensor(metric: Any, logits: Float[Tensor, "n vocab"], target: Tensor, counter: Tensor) -> Tensor:
    """The per-position metric as a differentiable scalar (``_causal.metric_value`` returns a float): mean
    logit difference, log-prob or prob of ``target`` over the n readout rows; a callable gets the logits and must
    return a 0-d floating tensor (a float has no gradient to attribute)."""
    if callable(metric):
        v = metric(logits)
        if not isinstance(v, Tensor) or v.ndim != 0 or not v.is_floating_point():
            raise ArgumentTypeError(f"metric returned {type(v).__name__}: attribution patching differentiates it, "
                                    "so it must return a 0-d floating tensor built from the logits.",
                                    argument="metric", value=metric, allowed="a callable returning a 0-d tensor")
        return v
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if metric == "logit_diff":
        return (lf.gather(-1, target[:, None]) - lf.gather(-1, counter[:, None])).mean()
    lp = lf.log_softmax(-1).gather(-1, target[:, None])
    return lp.mean() if metric == "logprob" else lp.exp().mean()


def _leaf(act: Tensor, hook: Any) -> Tensor:
    return act if act.requires_grad else act.detach().requires_grad_(True)


def _saver(store: dict[str, Tensor]) -> Callable:
    def hook(act: Tensor, hook: Any) -> None:
        store[hook.name] = act
    return hook


def run_side(model: Any, pair: StepPair, side: str, names: list[str], grad: bool,
             extra: list[tuple[str, Any]] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    """(logits, {hook name: activation}) of one side's forward; with ``grad`` the activations stay in the graph
    (``torch.enable_grad``: the samplers and the sweep run under ``no_grad``)."""
    store: dict[str, Tensor] = {}
    hooks = [(_ROOT, pair.quiet(_leaf))] if grad else []
    hooks += pair.side_hooks(side) + [(n, pair.quiet(_saver(store))) for n in names] + list(extra)
    with torch.set_grad_enabled(grad):
        raw = model.run_with_hooks(pair.tokens(side), attention_mask=pair.attention_mask, fwd_hooks=hooks,
                                   **pair.forward_kwargs)
    C.check_logits(raw.detach(), f"the {side} forward")
    return raw, store


def gradients(value: Tensor, acts: dict[str, Tensor]) -> dict[str, Tensor]:
    """d value / d activation for every saved activation (zeros where the value does not depend on it); only
    these gradients are computed (``autograd.grad``), never the parameters'."""
    names = list(acts)
    grads = torch.autograd.grad(value, [acts[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(acts[n]) if g is None else g for n, g in zip(names, grads)}


def _replace(source: Tensor, head: int | None) -> Callable:
    def hook(act: Tensor, hook: Any) -> Tensor:
        if head is None:
            return source.to(act.dtype)
        out = act.clone()
        out[:, :, head] = source[:, :, head].to(act.dtype)
        return out
    return hook


@torch.no_grad()
def exact_effects(model: Any, pair: StepPair, base: str, source: dict[str, Tensor], names: dict[str, list[str]],
                  n_heads: int, score: Callable[[Tensor], float], base_value: float) -> dict[str, Tensor]:
    """Activation patching of every (component, layer[, head]): the ``base`` side's forward with that
    activation (at every position, or that head's slice of ``hook_z``) taken from ``source``; the effect is
    the patched metric minus ``base_value``.  {component: [layer] or [layer, head]} in float64."""
    out = {}
    for comp, hook_names in names.items():
        heads = list(range(n_heads)) if comp in HEAD_COMPONENTS else [None]
        vals = torch.empty(len(hook_names), len(heads), dtype=torch.float64)
        for i, name in enumerate(hook_names):
            for j, h in enumerate(heads):
                raw, _ = run_side(model, pair, base, [], False, [(name, pair.quiet(_replace(source[name], h)))])
                vals[i, j] = score(raw) - base_value
        out[comp] = vals if comp in HEAD_COMPONENTS else vals[:, 0]
    return out
