"""Shapes of any hook point, measured on the model itself, for the memory estimate of a trajectory cache.

The estimate (`hooks.memory`) must know, before a run, how large each cached hook's activation is for the run's
batch and canvas. Rather than a list of known names (which misses MoE routing hooks, expert MLPs, q/k norms and
whatever a new family adds), two tiny forward passes with shape-recording hooks are run (batch 1 × 3 positions
and batch 2 × 5 positions), and each axis is solved as a constant, the batch, the positions or batch × positions
(MoE flattens tokens). An axis that changes in another way (the rows an expert receives depend on routing) and a
hook that did not fire in the probe (an expert no probe token was routed to) are bounded by the size a hook on
one token per row can reach: batch × positions rows of the widest per-row size measured for the same hook of a
sibling module (`experts.*`), so the estimate is an upper bound there, never an undercount."""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

Axis = int | str  # a constant size, or "b", "p", "bp" (batch × positions), "rows" (at most batch × positions)
_PROBES = ((1, 3), (2, 5))


def _record(model: Any, names: Sequence[str], batch: int, pos: int,
            itemsize: dict[str, int]) -> dict[str, tuple[int, ...]]:
    seen: dict[str, tuple[int, ...]] = {}

    def save(tensor: Any, hook: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            seen[hook.name] = tuple(tensor.shape)
            itemsize[hook.name] = tensor.element_size()

    fill = model.cfg.mask_token_id if getattr(model.cfg, "mask_token_id", None) is not None else 0
    device = next(model.parameters()).device
    tokens = torch.full((batch, pos), int(fill), dtype=torch.long, device=device)
    previous, model.state = getattr(model, "state", None), None  # a plain forward, not a step of a run
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=[(n, save) for n in names]):
            # logits: the final norm fires only on the way to them; an encoder-decoder (DiffusionGemma through the
            # bridge) gets the same ids as prompt and canvas, so encoder and decoder hooks both fire
            extra = {"decoder_input_ids": tokens} if getattr(model, "is_block_diffusion", False) else {}
            if callable(getattr(model, "step_sigma", None)):  # a DDiT: a time-conditioned BD3LM requires its σ
                extra["sigma"] = torch.zeros(batch, device=device)
            model(tokens, **extra)
    finally:
        model.state = previous
    return seen


def _solve(small: tuple[int, ...], large: tuple[int, ...]) -> tuple[Axis, ...] | None:
    if len(small) != len(large):
        return None
    (b1, p1), (b2, p2) = _PROBES
    out: list[Axis] = []
    for a, z in zip(small, large):
        if a == z:
            out.append(a)
        else:
            out.append({(b1, b2): "b", (p1, p2): "p", (b1 * p1, b2 * p2): "bp"}.get((a, z), "rows"))
    return tuple(out)


def measure(model: Any, names: Sequence[str], itemsize: dict[str, int] | None = None) -> dict[str, tuple[Axis, ...]]:
    """Per hook name, its axes (see `Axis`) as measured by two probe forwards of `model`; `itemsize`, when given,
    receives each fired hook's bytes per element (MoE indices are int64, LLaDA2's router logits fp32)."""
    if not names:
        return {}
    sizes: dict[str, int] = {} if itemsize is None else itemsize
    small, large = (_record(model, names, b, p, sizes) for b, p in _PROBES)
    out: dict[str, tuple[Axis, ...]] = {}
    for name in names:
        solved = _solve(small[name], large[name]) if name in small and name in large else None
        if solved is not None:
            out[name] = solved
    for name in names:
        if name not in out:  # never fired, or a rank that changes: bounded by its siblings' per-row width
            out[name] = ("rows", _sibling_width(model, name, out, small, large))
    return out


def _sibling_width(model: Any, name: str, solved: dict[str, tuple[Axis, ...]],
                   *runs: dict[str, tuple[int, ...]]) -> int:
    """The widest per-row size (the product of the constant axes) of the hooks whose name equals `name` up to
    module indices (`blocks.1.mlp.experts.3.hook_post` ~ `blocks.1.mlp.experts.0.hook_post`); the model's widest
    configured width when no sibling fired either."""
    pattern = re.compile(re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$")
    widths = [per_row(axes) for other, axes in solved.items() if pattern.match(other)]
    widths += [shape[-1] for run in runs for other, shape in run.items() if shape and pattern.match(other)]
    if widths:
        return max(widths)
    cfg = model.cfg
    return max(cfg.d_model, cfg.d_mlp or 0, cfg.n_heads * cfg.d_head)


def per_row(axes: Sequence[Axis]) -> int:
    """The product of the constant axes (the size per batch item, position or routed row)."""
    n = 1
    for a in axes:
        if isinstance(a, int):
            n *= a
    return n


def size(axes: Sequence[Axis], batch: int, pos: int) -> int:
    """Elements of an activation with these axes in a forward of `batch` × `pos` ("rows": at most batch × pos)."""
    n = per_row(axes)
    for a in axes:
        if isinstance(a, str):
            n *= {"b": batch, "p": pos, "bp": batch * pos, "rows": batch * pos}[a]
    return n
