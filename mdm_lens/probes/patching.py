"""Causal tests of anchors at a denoising step: activation patching (Zhang & Nanda 2023; Heimersheim &
Nanda 2024; spec §2.9–2.10) and, re-exported from :mod:`knockout`, attention knockout (Geva et al., §2.8).

Two directions, named as in the patching literature (Heimersheim & Nanda 2024, §2.10):

- **noising** (``direction="noising"``, the default): run the *clean* input and patch in activations
  from the *corrupted* run.  Tests *necessity*: if the metric falls, the clean run needed what those
  positions carried.  normalised = 1: no effect; 0: as bad as the fully corrupted run.
- **denoising** (``direction="denoising"``): run the *corrupted* input and patch in activations from the
  *clean* run.  Tests *sufficiency*: if the metric recovers, those positions carry enough to restore the
  clean behaviour.  normalised = 0: no recovery; 1: the clean run fully restored.  This is what
  ``transformer_lens.patching.get_act_patch_*(model, corrupted_tokens, clean_cache, metric)`` does.

Both use normalised = (M − M_corr) / (M_clean − M_corr), with M_clean and M_corr the metric of the
unpatched clean and corrupted forwards.  The corrupted input is the clean canvas at step s with the prompt
replaced (symmetric token replacement): :func:`matched_canvases` builds the pair, so that
``transformer_lens.patching`` runs on it unchanged:

    out = model.generate(clean_prompt, steps=8, gen_length=8)
    pair = matched_canvases(out, corrupt_prompt, step=3, model=model)
    _, clean_cache = model.run_with_cache(pair.clean)
    tl_patching.get_act_patch_resid_pre(model, pair.corrupted, clean_cache, metric)   # denoising

Metrics are read at the positions the clean run *committed* at the step, through their readout rows
(p, or p − 1 for shifted MDMs and ARMs): ``logit_diff`` = mean_p (logit_t − logit_c) with t the clean
committed token and c the counterfactual (``tokens[1]``, or the corrupted run's best token other than t,
fixed across conditions); ``prob`` / ``logprob`` = mean_p softmax(logits)_t / its log; a callable gets the
readout logits ``[n_positions, d_vocab]`` (same order in every condition).  Every hook lives in a
TransformerLens hook context and is removed afterwards, also when a run raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.probes._checks import own_generate_keywords
from mdm_lens.diffusion.fixed_length import refuse_variable_sampler
from mdm_lens import validate
from mdm_lens.errors import ArgumentError, StepForwardError

from . import _causal as C
from ._causal import anchor_mask_from_scores
from ._ignored import refuse_ignored
from ._results import ResultMixin
from .knockout import ANSWER_METRICS, KnockoutHooks, KnockoutResult, knockout
from ._runtools import require_single_stack
from .conditioning import sigma_patch  # noqa: F401  (patching.sigma_patch: the conditioning at one step)
from mdm_lens.noisy import notes_for

from ._runtools import noisy_canvas
from .run import is_causal, step_canvas, step_forward_kwargs

__all__ = ["knockout", "KnockoutResult", "KnockoutHooks", "ANSWER_METRICS", "patch_anchor_activations",
           "PatchingResult", "matched_canvases", "MatchedCanvases", "anchor_mask_from_scores", "COMPONENTS",
           "DIRECTIONS"]

COMPONENTS = {"resid_pre": "blocks.{l}.hook_resid_pre", "k": "blocks.{l}.attn.hook_k", "v": "blocks.{l}.attn.hook_v"}
DIRECTIONS = ("noising", "denoising")


# ----------------------------------------------------------------------------------------------
# matched clean / corrupted canvases at a step
# ----------------------------------------------------------------------------------------------

@dataclass
class MatchedCanvases:
    """A clean and a corrupted model input at denoising step ``step``: same length, same masked
    positions, same padding; they differ only in the prompt tokens (symmetric token replacement).

    ``clean`` is ``out.trajectory.x_steps[step]`` (the canvas *before* step s commits; an ARM's prefix
    ``prompt + s``); ``corrupted`` is that canvas with the corrupted prompt.  ``committed`` marks the
    positions the clean run committed at s (``[batch, total]``, the run's full length), ``differ`` the
    positions where the two inputs differ.  ``forward_kwargs`` make ``model(clean, attention_mask=...,
    **forward_kwargs)`` the forward the sampler ran: on a block sampler's run (``llada2``, ``sdar``) the canvas is
    the step forward's extent ``[0, query_end)`` and the kwargs carry the run's block length (as ``out.replay``).
    """

    clean: Int[Tensor, "batch pos"]
    corrupted: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    step: int
    masked: Bool[Tensor, "batch pos"] | None     # still-masked positions (None when no model was given)
    committed: Bool[Tensor, "batch total"]
    differ: Bool[Tensor, "batch pos"]
    forward_kwargs: dict = field(default_factory=dict)


def matched_canvases(out: Any, corrupt: Any, step: int, *, model: Any = None) -> MatchedCanvases:
    """Clean / corrupted canvases of a run at ``step`` (negatives count from the end).

    ``out``: the clean run's ``GenerateOutput``.  ``corrupt``: the corrupted prompt (token ids of the clean
    prompt's shape, ``[batch, prompt]`` or ``[prompt]``), or a ``GenerateOutput`` whose prompt is used
    (its padding must equal the clean one).  Only the prompt is replaced, so the masked positions match.
    With ``model``, ids are checked against its vocabulary and the corrupted prompt may not contain the
    mask token (that would change which positions are masked).  No padding ⇒ the pair runs through
    ``transformer_lens.patching`` unchanged (TL passes no attention mask)."""
    s = validate.index(step, out.n_steps, name="step", what="step")
    P = out.prompt_length
    x, am = step_canvas(out, s)
    if x.shape[1] < P:  # SDAR's prefill of the prompt's whole blocks: its canvas ends inside the prompt
        raise StepForwardError(
            f"step {s} of this {out.sampler!r} run is its prefill forward over the prompt's whole blocks [0, "
            f"{x.shape[1]}), inside the {P}-token prompt: no answer position, nothing to patch or attribute.",
            argument="step", value=s, allowed="a denoising step (state_at(step).extra['kind'] == 'denoise')")
    if hasattr(corrupt, "trajectory"):
        if not torch.equal(corrupt.attention_mask[:, :P].cpu(), out.attention_mask[:, :P].cpu()):
            raise ArgumentError("corrupt has a different prompt padding than the clean run; pad both prompts the same "
                                "way.", argument="corrupt", value=corrupt, allowed="the clean run's padding")
        corrupt = corrupt.tokens[:, :P]
    cp = C.prompt_batch(corrupt, "corrupt", x.device)
    validate.same_shape(out.tokens[:, :P], cp, names=("the clean prompt", "corrupt"))
    if model is not None:
        lo, hi = int(cp.min()), int(cp.max())
        if lo < 0 or hi >= model.cfg.d_vocab:
            raise ArgumentError(f"corrupt has token ids in [{lo}, {hi}], outside the vocabulary [0, "
                                f"{model.cfg.d_vocab}).", argument="corrupt", value=cp,
                                allowed=f"ids in [0, {model.cfg.d_vocab})")
        mask_id = model.cfg.mask_token_id
        if mask_id is not None and bool((cp == mask_id).any()):
            raise ArgumentError(f"corrupt contains the mask token {mask_id}, which would change the masked positions.",
                                argument="corrupt", value=cp, allowed="no mask token")
    xc = x.clone()
    xc[:, :P] = cp
    masked = None
    if model is not None:
        masked = torch.zeros_like(x, dtype=torch.bool) if is_causal(model) else noisy_canvas(model, x, P)
    return MatchedCanvases(clean=x, corrupted=xc, attention_mask=am, step=s, masked=masked,
                           committed=out.trajectory.commit_step.to(x.device) == s, differ=x != xc,
                           forward_kwargs=step_forward_kwargs(out, s))


# ----------------------------------------------------------------------------------------------
# activation patching at anchor positions
# ----------------------------------------------------------------------------------------------

@dataclass
class PatchingResult(ResultMixin):
    """Patching at a step, per layer and position set (see the module docstring for the two directions).

    ``value`` is the metric of the patched forward; normalised = (value − corrupt_value) / (clean_value −
    corrupt_value).  Noising: 1 = the positions are not necessary, 0 = as bad as the corrupted input.
    Denoising: 1 = the positions alone restore the clean run (sufficient), 0 = no recovery."""

    step: int
    component: str
    direction: str
    layers: list[int]
    conditions: list[str]
    metric: str
    clean_value: float
    corrupt_value: float
    value: Tensor               # [condition, layer]
    normalised: Tensor          # [condition, layer]
    n_positions: Tensor         # [condition, layer]  mean patched positions per row
    notes: list[str] = field(default_factory=list)
    # [condition][layer]: why `normalised` is NaN there ("" where it is a number)
    reason: list[list[str]] = field(default_factory=list)

    _dims: ClassVar = {"value": ("condition", "layer"), "normalised": ("condition", "layer"),
                       "n_positions": ("condition", "layer")}

    def _coords(self):
        return {"condition": self.conditions, "layer": self.layers}

    def _reason(self, name: str, values: Any) -> tuple[Any, Any]:
        """The frame's `reason` column: why that (condition, layer)'s normalised value is undefined (NaN), "" where
        it is defined; every field's row of that cell carries it."""
        return values, np.array(self.reason, dtype=object).reshape(values.shape)

    def table(self):
        """Wide summary: normalised metric, one row per layer, one column per condition."""
        return self.to_frame(metrics=["normalised"]).pivot(index="layer", columns="condition", values="value")


def _patch_hook(source: Tensor, mask: Tensor):
    def hook(act: Tensor, hook: Any) -> Tensor:
        m = mask.reshape(*mask.shape, *([1] * (act.ndim - 2))).to(act.device)
        return torch.where(m, source.to(act.dtype), act)
    return hook


def _position_sets(positions: Any, anchors: Tensor, kv: Tensor, gen: torch.Generator,
                   n_random: int) -> list[tuple[str, Tensor]]:
    if isinstance(positions, str):
        base, name = anchors, "anchors"
    else:
        base = torch.zeros_like(kv)
        base[:, list(positions)] = True
        base, name = base & kv, "positions"
    return [(name, base)] + [(f"random{i}" if n_random > 1 else "random", C.random_like(base, kv, gen))
                             for i in range(n_random)]


def _check_patch_args(model: Any, component: Any, direction: Any, metric: Any, tokens: Any, n_random: Any,
                      seed: Any) -> None:
    validate.choice(component, tuple(COMPONENTS), name="component")
    validate.choice(direction, DIRECTIONS, name="direction")
    C.check_position_metric(metric)
    if tokens is not None:
        if not isinstance(tokens, (tuple, list)) or len(tokens) != 2:
            raise ArgumentError(f"tokens={tokens!r} is invalid: expected (correct_id, counterfactual_id).",
                                argument="tokens", value=tokens, allowed="a pair of token ids")
        for i, t in enumerate(tokens):
            validate.integer(t, name=f"tokens[{i}]", min=0, max=model.cfg.d_vocab - 1)
    validate.integer(n_random, name="n_random", min=0)
    validate.seed(seed, min=None)


@torch.no_grad()
def patch_anchor_activations(model: Any, clean_ids: Any, corrupt_ids: Any, *, step: int = 0,
                             layers: Sequence[int] | None = None,
                             component: Literal["resid_pre", "k", "v"] = "resid_pre", positions: Any = "anchors",
                             direction: Literal["noising", "denoising"] = "noising",
                             metric: C.Metric = "logit_diff", tokens: tuple[int, int] | None = None,
                             rule: str = "zscore", n_random: int = 1, seed: int = 0, gen_length: int | None = None,
                             n_steps: int | None = None, **generate_kwargs: Any) -> PatchingResult:
    """Patch activations at anchor positions between a clean and a corrupted run, layer by layer.

    The clean prompt is sampled; at ``step`` (negatives count from the end) the matched canvases come from
    :func:`matched_canvases`.  For each layer l, ``component`` (``blocks.l.hook_resid_pre``,
    ``attn.hook_k`` or ``attn.hook_v``) is patched at the positions: ``"anchors"`` = the clean step
    forward's layer-l anchors (head-mean, ``rule``; the same positions in both directions), or a fixed
    list; plus ``n_random`` random controls of the same count.  ``direction="noising"``: corrupted
    activations into the clean run (necessity); ``"denoising"``: clean activations into the corrupted run
    (sufficiency).  Metric at the positions committed at s (default logit diff: correct = the clean
    committed token or ``tokens[0]``, counterfactual = ``tokens[1]`` or the corrupted forward's best other
    token), normalised (M − M_corr)/(M_clean − M_corr).  Raises ``OutOfRangeError`` for a step, layer or
    position outside the run and ``ArgumentError`` when nothing is committed at the step.
    """
    own_generate_keywords(generate_kwargs, patch_anchor_activations)
    refuse_variable_sampler(generate_kwargs, 'patch_anchor_activations',
                            'a patched position would be a different token at another step')
    require_single_stack(model, "patch_anchor_activations", "it replays a step as one forward of the whole canvas "
                         "(matched clean and corrupted canvases with mask tokens); DiffusionGemma has no such forward.")
    _check_patch_args(model, component, direction, metric, tokens, n_random, seed)
    dev = model.input_device
    clean_p = C.prompt_batch(clean_ids, "clean_ids", dev)
    corrupt_p = C.prompt_batch(corrupt_ids, "corrupt_ids", dev)
    validate.same_shape(clean_p, corrupt_p, names=("clean_ids", "corrupt_ids"))
    g = validate.integer(gen_length if gen_length is not None else model.cfg.extra.get("gen_length", 4),
                         name="gen_length", min=1)
    ns = g if is_causal(model) else derived_steps(
        None if n_steps is None else validate.integer(n_steps, name="n_steps", min=1), g)
    validate.integer(step, name="step")
    ls = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    clean = model.generate(clean_p, steps=ns, gen_length=g, **generate_kwargs)
    # the run's own step count: a block sampler's `steps` is per block, so its run has more forwards than ns
    s = validate.index(step, clean.n_steps, name="step", what=f"step of this {clean.n_steps}-step run")
    pair = matched_canvases(clean, corrupt_p, s, model=model)
    if not isinstance(positions, str):
        positions = validate.indices(positions, pair.clean.shape[1], name="positions", what="position")
        refuse_ignored("rule", rule, "zscore", by="positions", by_value=positions, why="rule picks the anchors only "
                       "when positions='anchors'")
    else:
        validate.choice(positions, ("anchors",), name="positions")
    committed = pair.committed
    if not bool(committed.any()):
        raise ArgumentError(f"step={s} is invalid: no position was committed at step {s}; choose another step.",
                            argument="step", value=step, allowed="a step that commits a position")
    x, xc, am, kw = pair.clean, pair.corrupted, pair.attention_mask, pair.forward_kwargs
    names = [COMPONENTS[component].format(l=l) for l in ls]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in ls]
    raw_c, cache_c = model.run_with_cache(x, attention_mask=am, names_filter=scores + names, **kw)
    raw_x, cache_x = model.run_with_cache(xc, attention_mask=am, names_filter=names, **kw)
    C.check_logits(raw_c, "the clean forward")
    C.check_logits(raw_x, "the corrupted forward")
    target = clean.tokens[committed] if tokens is None else torch.full_like(clean.tokens[committed], tokens[0])
    ro_c, ro_x = C.readout(model, raw_c, committed), C.readout(model, raw_x, committed)
    counter = (C.best_other(ro_x, target, model.cfg.mask_token_id) if tokens is None
               else torch.full_like(target, tokens[1]))
    v_clean, v_corr = (C.metric_value(metric, r, target, counter) for r in (ro_c, ro_x))
    # noising runs the clean input with corrupted activations; denoising the reverse
    run_input, source = (x, cache_x) if direction == "noising" else (xc, cache_c)
    gen = torch.Generator().manual_seed(seed)
    table: dict[str, list[tuple[float, float]]] = {}
    for l, name, sc in zip(ls, names, scores):
        anchors, kv = anchor_mask_from_scores(cache_c[sc], rule, is_causal(model))
        for cond, mask in _position_sets(positions, anchors, kv, gen, n_random):
            raw = model.run_with_hooks(run_input, attention_mask=am, **kw,
                                       fwd_hooks=[(name, _patch_hook(source[name], mask))])
            table.setdefault(cond, []).append((C.metric_value(metric, C.readout(model, raw, committed), target,
                                                              counter), float(mask.sum(-1).float().mean())))
    conds = list(table)
    value = torch.tensor([[v for v, _ in table[c]] for c in conds], dtype=torch.float64)
    n_pos = torch.tensor([[n for _, n in table[c]] for c in conds], dtype=torch.float64)
    scale = max(float(ro_c.abs().max()), float(ro_x.abs().max()))
    norm, reason, notes = normalise(value, v_clean, v_corr, n_pos, raw_c.dtype, scale)
    return PatchingResult(step=s, component=component, direction=direction, layers=ls, conditions=conds,
                          metric=C.metric_name(metric), clean_value=v_clean, corrupt_value=v_corr, value=value,
                          normalised=norm, n_positions=n_pos, notes=notes_for(model.cfg) + notes, reason=reason)


EQUAL_RUNS = "clean and corrupted metrics are equal (0/0): the corruption changed nothing to restore"
NOTHING_PATCHED = "no position to patch at this layer (no anchors), so nothing was tested"


def normalise(value: Tensor, clean: float, corrupt: float, n_positions: Tensor, logits_dtype: torch.dtype,
              logit_scale: float = 0.0) -> tuple[Tensor, list[list[str]], list[str]]:
    """(value − corrupt) / (clean − corrupt), NaN with a reason where it is undefined: the two runs' metrics
    agree to within the logits' precision (0/0: 16 ulps of the largest of the two metrics and the readout
    logits, since the same input through differently hooked forwards already differs by a few ulps of
    the logits), or no position was patched in any row (the "patched" run is then the unpatched one, so
    its 1 or 0 would be a fake result)."""
    denom = clean - corrupt
    precision = 16 * torch.finfo(logits_dtype).eps * max(abs(clean), abs(corrupt), logit_scale)
    equal = abs(denom) <= precision
    norm = torch.full_like(value, torch.nan) if equal else (value - corrupt) / denom
    empty = n_positions == 0
    norm = norm.masked_fill(empty, torch.nan)
    reason = [[EQUAL_RUNS if equal else (NOTHING_PATCHED if bool(e) else "") for e in row] for row in empty]
    notes = [f"{EQUAL_RUNS}: normalised is NaN"] if equal else []
    if bool(empty.any()):
        notes.append(f"{int(empty.sum())} (condition, layer) cell(s) patched no position: normalised is NaN there")
    return norm, reason, notes
