"""Attribution patching (AtP) over denoising steps: a first-order estimate of activation patching at every
component at once (Nanda 2023, "Attribution Patching"; Kramár et al. 2024, "AtP*").

At step s of a clean run the pair of inputs is :func:`patching.matched_canvases` (the clean canvas and the
same canvas with the corrupted prompt), or the clean canvas under attention knockout of the anchors
(``corrupt="knockout"``: the corrupted activations are the knocked-out forward's).  For an activation a:

- ``direction="noising"``: effect of patching the corrupted a into the clean run ≈ (a_corr − a_clean) · ∂M/∂a
  evaluated on the clean run;
- ``direction="denoising"``: effect of patching the clean a into the corrupted run ≈ (a_clean − a_corr) ·
  ∂M/∂a evaluated on the corrupted run.

Per step: one forward on the source side and one forward + backward on the base side, whatever the number of
components (that is the point; the exact loop of :func:`atp_vs_patching` costs one forward per cell).  The
metric M is patching's, read at the positions the clean run committed at s through their readout rows:
``logprob`` / ``prob`` of the clean committed token, ``logit_diff`` against the corrupted forward's best other
token, or a callable on the readout logits ``[n, vocab]`` returning a 0-d tensor.  Heads come from ``hook_z``
(``[batch, pos, head, d_head]``; the head's output is z_h W_O[h], so the per-head estimates sum to the
``attn_out`` one).  Estimates sum over positions (and batch rows) unless ``per_position=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.probes._checks import own_generate_keywords, unknown_keywords
from mdm_lens.diffusion.fixed_length import refuse_variable_sampler, require_fixed_length
from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError, StepForwardError
from mdm_lens.noisy import notes_for

from . import _causal as C
from ._atp_runs import COMPONENTS, HEAD_COMPONENTS, StepPair, exact_effects, gradients, metric_tensor, run_side
from ._knockout_hooks import KnockoutHooks
from ._runtools import require_single_stack
from .patching import DIRECTIONS, matched_canvases
from .run import is_causal

__all__ = ["attribution_patching", "atp_vs_patching", "AttributionResult", "COMPONENTS", "DEFAULT_COMPONENTS",
           "NOTHING_COMMITTED"]

DEFAULT_COMPONENTS = ("resid_pre", "attn_out", "mlp_out", "z")
NOTHING_COMMITTED = "no position was committed at this step: no metric to attribute"


@dataclass
class AttributionResult:
    """AtP estimates of one clean run, per step.

    ``estimates[component]``: ``[step, layer]`` (``[step, layer, head]`` for ``z``), float64, summed over the
    canvas positions and batch rows; NaN with ``reason[i]`` at a step with nothing to attribute.
    ``per_position[component][i]``: step i's ``[layer, (head,) batch, pos]`` (positions of that step's canvas:
    an ARM's prefix grows), when asked.  ``exact`` (same shapes as ``estimates``) holds activation patching's
    effect (patched − unpatched metric) when :func:`atp_vs_patching` filled it.  ``clean_value`` /
    ``corrupt_value``: the unpatched metrics per step.  ``corruption``: ``"prompt"``, ``"knockout"`` or
    ``"hooks"``."""

    steps: list[int]
    layers: list[int]
    components: list[str]
    direction: str
    metric: str
    corruption: str
    estimates: dict[str, Tensor]
    clean_value: list[float]
    corrupt_value: list[float]
    reason: list[str]
    per_position: dict[str, list[Tensor | None]] | None = None
    exact: dict[str, Tensor] | None = None
    notes: list[str] = field(default_factory=list)

    def to_frame(self) -> pd.DataFrame:
        """One row per (step, component, layer, head[, batch, position]): ``value`` (the estimate), ``exact``
        (only when validated), ``metric``, ``direction``, ``corruption``, ``reason`` ("" where defined).
        ``head`` is ``<NA>`` for whole-layer components; per position, the rows replace the summed ones."""
        parts = [self._rows(c) for c in self.components]
        df = pd.concat(parts, ignore_index=True)
        for c in ("step", "layer", "head", "batch", "position"):
            if c in df:
                df[c] = df[c].astype("Int64")
        return df

    def _rows(self, comp: str) -> pd.DataFrame:
        est = self.estimates[comp]
        heads = est.shape[-1] if comp in HEAD_COMPONENTS else 0
        rows = []
        for i, s in enumerate(self.steps):
            if self.per_position is not None and self.per_position[comp][i] is not None:
                rows.append(self._position_rows(comp, i, heads))
                continue
            v = est[i].reshape(len(self.layers), -1).numpy()
            li, hi = np.indices(v.shape).reshape(2, -1)
            row = dict(step=s, component=comp, layer=np.asarray(self.layers)[li],
                       head=hi.astype(float) if heads else np.full(len(li), np.nan), value=v.reshape(-1))
            if self.exact is not None:
                row["exact"] = self.exact[comp][i].reshape(-1).numpy()
            rows.append(pd.DataFrame(row))
            rows[-1]["reason"] = self.reason[i]
        df = pd.concat(rows, ignore_index=True)
        df["metric"], df["direction"], df["corruption"] = self.metric, self.direction, self.corruption
        return df

    def _position_rows(self, comp: str, i: int, heads: int) -> pd.DataFrame:
        t = self.per_position[comp][i]                                    # [layer, (head,) batch, pos]
        t = t if heads else t[:, None]
        li, hi, bi, pi = np.indices(t.shape).reshape(4, -1)
        return pd.DataFrame(dict(step=self.steps[i], component=comp, layer=np.asarray(self.layers)[li],
                                 head=hi.astype(float) if heads else np.full(len(li), np.nan), batch=bi,
                                 position=pi, value=t.reshape(-1).numpy(), reason=self.reason[i]))

    def agreement(self) -> pd.DataFrame:
        """AtP vs exact patching per component and over all of them: ``n`` cells (finite in both), Pearson
        ``r``, ``sign_agreement`` (share of cells with exact ≠ 0 where the signs agree) and ``reason`` where a
        figure is undefined (NaN: fewer than 2 cells, a constant column, no non-zero exact effect)."""
        if self.exact is None:
            raise InputError("agreement() needs the exact effects: run atp_vs_patching.", argument="exact",
                             value=None, allowed="a result of atp_vs_patching")
        rows = [_agree(c, self.estimates[c], self.exact[c]) for c in self.components]
        rows.append(_agree("all", torch.cat([self.estimates[c].reshape(-1) for c in self.components]),
                           torch.cat([self.exact[c].reshape(-1) for c in self.components])))
        return pd.DataFrame(rows)


def _agree(name: str, est: Tensor, exact: Tensor) -> dict:
    a, b = est.reshape(-1).double(), exact.reshape(-1).double()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok], b[ok]
    reason, r, sign = [], math.nan, math.nan
    if len(a) < 2 or float(a.std()) == 0 or float(b.std()) == 0:
        reason.append("Pearson r undefined: fewer than 2 cells or a constant column")
    else:
        r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    nz = b != 0
    if bool(nz.any()):
        sign = float((torch.sign(a[nz]) == torch.sign(b[nz])).double().mean())
    else:
        reason.append("sign agreement undefined: no cell with a non-zero exact effect")
    return dict(component=name, n=int(len(a)), pearson=r, sign_agreement=sign, reason="; ".join(reason))


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------

def _components(components: Any) -> list[str]:
    if isinstance(components, str) or not isinstance(components, Sequence) or not components:
        raise ArgumentTypeError(f"components={components!r} is invalid: expected a non-empty list of names.",
                                argument="components", value=components, allowed=str(tuple(COMPONENTS)))
    out = [validate.choice(c, tuple(COMPONENTS), name="components") for c in components]
    if len(set(out)) != len(out):
        raise ArgumentTypeError(f"components={components!r} names a component twice.", argument="components",
                                value=components, allowed="distinct names")
    return out


def _refuse_cached(out: Any) -> None:
    """A KV-cached run's forwards read stale keys/values that no fresh step forward reproduces."""
    settings = getattr(out, "settings", {}) or {}
    for key in ("kv_cache", "use_block_cache"):
        if settings.get(key) not in (None, False):
            raise InputError(f"attribution patching needs runs whose step forward is a fresh forward of the canvas; "
                             f"this run has {key}={settings[key]!r}: rerun it without the cache.",
                             argument="out_or_clean", value=settings[key], allowed=f"a run without {key}")


def _clean_run(model: Any, out_or_clean: Any, gen_length: Any, n_steps: Any, generate_kwargs: dict) -> Any:
    if hasattr(out_or_clean, "trajectory"):
        if hasattr(out_or_clean, "check_model"):
            out_or_clean.check_model(model, argument="out_or_clean")
        given = {k: v for k, v in dict(generate_kwargs, gen_length=gen_length, n_steps=n_steps).items()
                 if v is not None}
        if given:  # a finished run is read as it ran: generation settings would be ignored
            from mdm_lens.errors import ArgumentError

            name = sorted(given)[0]
            raise ArgumentError(f"{name}={validate.describe(given[name])} is ignored when out_or_clean is a finished "
                                f"run (it is read as it ran); pass prompt ids to sample with settings, or drop "
                                f"{', '.join(sorted(given))}.", argument=name, value=given[name],
                                allowed="no generation settings with a GenerateOutput")
        return out_or_clean
    unknown_keywords(generate_kwargs, attribution_patching)
    clean = C.prompt_batch(out_or_clean, "out_or_clean", model.input_device)
    g = validate.integer(gen_length if gen_length is not None else model.cfg.extra.get("gen_length", 4),
                         name="gen_length", min=1)
    ns = g if is_causal(model) else derived_steps(
        None if n_steps is None else validate.integer(n_steps, name="n_steps", min=1), g)
    with torch.no_grad():
        return model.generate(clean, steps=ns, gen_length=g, **generate_kwargs)


def _hook_list(model: Any, corrupt: Any) -> tuple | None:
    """``corrupt`` as a list of ``(hook name, fn)`` forward hooks, checked; None when it is not a hook list."""
    if not _hook_like(corrupt):
        return None
    for i, h in enumerate(corrupt):
        if len(h) != 2 or not isinstance(h[0], str) or not callable(h[1]):
            raise ArgumentTypeError(f"corrupt[{i}]={h!r} is invalid: expected a (hook name, function) pair.",
                                    argument=f"corrupt[{i}]", value=h, allowed="(str, callable)")
        validate.choice(h[0], tuple(model.hook_dict), name=f"corrupt[{i}][0]")
    return tuple(corrupt)


def _pair(model: Any, out: Any, corrupt: Any, s: int) -> StepPair:
    hooks = _hook_list(model, corrupt)
    if hooks is not None:
        m = matched_canvases(out, out.tokens[:, :out.prompt_length], s, model=model)
        return StepPair(m.clean.clone(), m.clean.clone(), m.attention_mask.clone(), m.forward_kwargs, m.committed,
                        corrupt_hooks=hooks)
    if isinstance(corrupt, str):
        validate.choice(corrupt, ("knockout",), name="corrupt")
        m = matched_canvases(out, out.tokens[:, :out.prompt_length], s, model=model)
        ko = KnockoutHooks(model, range(model.cfg.n_layers), "anchors", "masked", prompt_length=out.prompt_length)
        return StepPair(m.clean.clone(), m.clean.clone(), m.attention_mask.clone(), m.forward_kwargs, m.committed, ko)
    m = matched_canvases(out, corrupt, s, model=model)
    # clones: a sampler's tensors may be inference-mode tensors, which autograd refuses to save
    return StepPair(m.clean.clone(), m.corrupted.clone(), m.attention_mask.clone(), m.forward_kwargs, m.committed)


# ----------------------------------------------------------------------------------------------
# the estimate at one step
# ----------------------------------------------------------------------------------------------

@torch.enable_grad()   # callers (the samplers' users, the sweep) may run under no_grad; the backward needs a graph
def _step(model: Any, out: Any, pair: StepPair, names: dict[str, list[str]], metric: Any, direction: str,
          per_position: bool, exact: bool) -> dict[str, Any]:
    """AtP at one step: the source side's activations, the base side's activations and gradients."""
    base, source = ("clean", "corrupt") if direction == "noising" else ("corrupt", "clean")
    flat = [n for ns in names.values() for n in ns]
    target = out.tokens.to(pair.committed.device)[pair.committed]
    raw_src, acts_src = run_side(model, pair, source, flat, grad=False)
    raw_base, acts_base = run_side(model, pair, base, flat, grad=True)
    corr_raw = raw_src if source == "corrupt" else raw_base
    counter = C.best_other(C.readout(model, corr_raw.detach(), pair.committed), target, model.cfg.mask_token_id)
    m_base = metric_tensor(metric, C.readout(model, raw_base, pair.committed), target, counter)
    m_src = float(metric_tensor(metric, C.readout(model, raw_src, pair.committed), target, counter))
    grads = gradients(m_base, acts_base)
    res: dict[str, Any] = {"base": float(m_base.detach()), "source": m_src, "est": {}, "pos": {}}
    for comp, ns in names.items():
        per = torch.stack([((acts_src[n].detach() - acts_base[n].detach()) * grads[n]).sum(-1).double().cpu()
                           for n in ns])                                  # [layer, batch, pos(, head)]
        if comp in HEAD_COMPONENTS:
            per = per.permute(0, 3, 1, 2)                                 # [layer, head, batch, pos]
        res["est"][comp] = per.sum((-2, -1))
        res["pos"][comp] = per if per_position else None
    if exact:
        def score(raw: Tensor) -> float:
            return float(metric_tensor(metric, C.readout(model, raw, pair.committed), target, counter))
        res["exact"] = exact_effects(model, pair, base, {n: a.detach() for n, a in acts_src.items()}, names,
                                     model.cfg.n_heads, score, float(m_base.detach()))
    return res


def attribution_patching(model: Any, out_or_clean: Any, corrupt: Any, *, steps: Any = None, layers: Any = None,
                         components: Sequence[str] = DEFAULT_COMPONENTS, metric: C.Metric = "logprob",
                         direction: str = "noising", per_position: bool = False, gen_length: int | None = None,
                         n_steps: int | None = None, _exact: bool = False,
                         **generate_kwargs: Any) -> AttributionResult:
    """AtP estimates of activation patching per step, component, layer (and head, from ``hook_z``).

    ``out_or_clean``: the clean run's ``GenerateOutput``, or clean prompt ids (sampled here with
    ``gen_length``, ``n_steps`` and ``generate_kwargs``).  ``corrupt``: corrupted prompt ids of the clean
    prompt's shape (or a run whose prompt is used), or ``"knockout"`` (the anchors of every layer knocked out
    from the still-masked queries, as :func:`knockout` does at a step), or a list of ``(hook name, fn)`` forward
    hooks that corrupt the clean canvas's forward (e.g. noise on ``hook_embed``, ROME-style).  ``steps``: the run's steps (None = all;
    negatives count from the end).  ``components``: names of :data:`COMPONENTS`.  ``direction``: ``"noising"``
    or ``"denoising"`` (see the module docstring).  Refuses block-diffusion models (DiffusionGemma) and
    KV-cached runs (``InputError``), out-of-range steps and layers (``OutOfRangeError``).  A step that commits
    no position gets NaN estimates with reason :data:`NOTHING_COMMITTED`.  On the windowed samplers a BD3LM step
    (``kv_cache=False``, its window starting at 0) is one canvas forward at the step's σ, run exactly; a step whose
    window slid past model_length, and every Nemotron step (a block read against a KV cache), is NaN with the
    reason (``StepForwardError``'s message)."""
    own_generate_keywords(generate_kwargs, 'attribution_patching')  # unknown keys: `_clean_run`, after a run's refusal
    refuse_variable_sampler(generate_kwargs, 'attribution_patching',
                            'an attribution at column j would sum over different tokens across steps')
    require_fixed_length(out_or_clean, 'attribution_patching', 'an attribution at column j would sum over '
                         'different tokens across steps')
    require_single_stack(model, "attribution_patching", "it replays a step as one forward of the whole canvas.")
    comps = _components(components)
    validate.choice(direction, DIRECTIONS, name="direction")
    C.check_position_metric(metric)
    validate.boolean(per_position, name="per_position")
    ls = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    if isinstance(corrupt, str):
        validate.choice(corrupt, ("knockout",), name="corrupt")
    _hook_list(model, corrupt)
    out = _clean_run(model, out_or_clean, gen_length, n_steps, generate_kwargs)
    _refuse_cached(out)
    step_list = validate.indices(steps, out.n_steps, name="steps", what=f"step of this {out.n_steps}-step run")
    names = {c: [COMPONENTS[c].format(l=l) for l in ls] for c in comps}
    per_step: list = []
    for s in step_list:
        try:
            pair = _pair(model, out, corrupt, s)
        except StepForwardError as e:  # a windowed step no canvas forward reproduces: NaN with the reason
            per_step.append(e.args[0])
            continue
        per_step.append(_step(model, out, pair, names, metric, direction, per_position, _exact)
                        if bool(pair.committed.any()) else None)
    return _result(model, step_list, ls, comps, direction, metric, corrupt, per_step, per_position, _exact)


def _nan_like(model: Any, comp: str, n_layers: int) -> Tensor:
    shape = (n_layers, model.cfg.n_heads) if comp in HEAD_COMPONENTS else (n_layers,)
    return torch.full(shape, torch.nan, dtype=torch.float64)


def _corruption_name(corrupt: Any) -> str:
    return "knockout" if isinstance(corrupt, str) else "hooks" if _hook_like(corrupt) else "prompt"


def _hook_like(corrupt: Any) -> bool:
    return isinstance(corrupt, (list, tuple)) and bool(corrupt) and all(isinstance(h, tuple) for h in corrupt)


def _result(model: Any, steps: list[int], ls: list[int], comps: list[str], direction: str, metric: Any,
            corrupt: Any, per_step: list, per_position: bool, exact: bool) -> AttributionResult:
    def stack(key: str) -> dict[str, Tensor]:
        return {c: torch.stack([r[key][c] if isinstance(r, dict) else _nan_like(model, c, len(ls)) for r in per_step])
                for c in comps}

    def value(r: Any, key: str) -> float:
        return r[key] if isinstance(r, dict) else math.nan
    # noising's base is the clean run, denoising's the corrupted one
    clean_key, corr_key = ("base", "source") if direction == "noising" else ("source", "base")
    return AttributionResult(
        steps=steps, layers=ls, components=comps, direction=direction, metric=C.metric_name(metric),
        corruption=_corruption_name(corrupt), estimates=stack("est"),
        clean_value=[value(r, clean_key) for r in per_step], corrupt_value=[value(r, corr_key) for r in per_step],
        reason=["" if isinstance(r, dict) else NOTHING_COMMITTED if r is None else r for r in per_step],
        per_position={c: [r["pos"][c] if isinstance(r, dict) else None for r in per_step] for c in comps}
        if per_position
        else None, exact=stack("exact") if exact else None, notes=notes_for(model.cfg))


def atp_vs_patching(model: Any, out_or_clean: Any, corrupt: Any, **kwargs: Any) -> AttributionResult:
    """:func:`attribution_patching` plus exact activation patching of every (step, component, layer, head)
    cell: the base run with that activation (all positions; one head's slice of ``hook_z``) taken from the
    source run, effect = patched − unpatched metric.  ``result.exact`` holds them, ``result.agreement()`` the
    Pearson r and sign agreement, ``result.to_frame()`` both side by side.  Costs one forward per cell."""
    return attribution_patching(model, out_or_clean, corrupt, _exact=True, **kwargs)
