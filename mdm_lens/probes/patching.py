"""Causal tests of anchors: attention knockout (Geva et al., §2.8) and activation patching at a
denoising step (Zhang & Nanda; Heimersheim & Nanda, §2.9–2.10).

Metrics are read at the *committed* positions of a step, through their readout rows (p, or p − 1 for
shifted MDMs and ARMs).  Built-ins, with target t = the clean run's committed token and counterfactual c:

- ``logit_diff``: mean_p (logit_t − logit_c) — knockout (no counterfactual prompt): c = the strongest
  other token of the same logits, i.e. the margin of t, negative once t is no longer the argmax;
  patching: c = the corrupted run's best token other than t, fixed across conditions;
- ``prob`` / ``logprob``: mean_p softmax(logits)_t / its log.

A custom ``metric(logits) -> float`` receives the readout logits ``[n_positions, d_vocab]`` of the
committed positions (same order in every condition).  Every hook lives in a TransformerLens hook
context (``run_with_hooks`` / ``hooks()`` / the sampler's per-step contexts) and is removed afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from mdm_lens.hooks import at_steps
from mdm_lens.hooks.steps import Steps

from . import floating
from ._results import ResultMixin
from .retrieval import answer_correct
from .run import _batch, is_causal, layer_list, readout_shift, step_canvas

__all__ = ["knockout", "KnockoutResult", "KnockoutHooks", "patch_anchor_activations", "PatchingResult",
           "anchor_mask_from_scores", "COMPONENTS"]

Metric = Literal["logit_diff", "prob", "logprob"] | Callable[[Tensor], Any]
COMPONENTS = {"resid_pre": "blocks.{l}.hook_resid_pre", "k": "blocks.{l}.attn.hook_k", "v": "blocks.{l}.attn.hook_v"}


# ----------------------------------------------------------------------------------------------
# shared pieces
# ----------------------------------------------------------------------------------------------

def anchor_mask_from_scores(scores: Tensor, rule: str = "zscore", causal: bool = False,
                            **detect_kwargs: Any) -> tuple[Tensor, Tensor]:
    """(anchors [batch, key], key_visible [batch, key]) of one layer from its pre-softmax scores
    ``[batch, head, query, key]``: head-mean softmax pattern → mass received over the query rows that
    see any key → ``floating.detect_anchors(rule)``."""
    finite = torch.isfinite(scores)
    kv, rows = finite.any(1).any(1), finite.any(1).any(-1)                 # [b, key], [b, query]
    pattern = torch.nan_to_num(torch.softmax(scores.float(), -1), nan=0.0).mean(1).to(torch.float64)
    rec = floating.received_attention(pattern, query_mask=rows, key_visible=kv, causal=causal)
    return floating.detect_anchors(rec, rule=rule, key_visible=kv, causal=causal, **detect_kwargs), kv


def _random_like(anchors: Tensor, visible: Tensor, gen: torch.Generator) -> Tensor:
    """Per row, as many random visible non-anchor keys as the row has anchors."""
    out = torch.zeros_like(anchors)
    cand_all = visible & ~anchors
    for b in range(anchors.shape[0]):
        cand = cand_all[b].nonzero().flatten().cpu()
        n = min(int(anchors[b].sum()), len(cand))
        if n:
            out[b, cand[torch.randperm(len(cand), generator=gen)[:n]].to(out.device)] = True
    return out


def _readout_rows(model: Any, tokens: Tensor, prompt_length: int, queries: str) -> Tensor:
    """Query rows of a forward: all, the readout rows q(p) of masked positions, or of canvas positions.
    For an ARM, "masked" is the emitting (last) row and "answer" every row ≥ prompt_length − 1."""
    b, T = tokens.shape
    if queries == "all":
        return torch.ones(b, T, dtype=torch.bool, device=tokens.device)
    if is_causal(model):
        rows = torch.zeros(b, T, dtype=torch.bool, device=tokens.device)
        if queries == "masked":
            rows[:, -1] = True
        else:
            rows[:, max(prompt_length - 1, 0):] = True
        return rows
    pos = torch.zeros_like(tokens, dtype=torch.bool)
    if queries == "masked":
        pos = tokens == model.cfg.mask_token_id
    elif queries == "answer":
        pos[:, prompt_length:] = True
    else:
        raise ValueError(f"queries must be 'masked', 'all' or 'answer', got {queries!r}")
    if readout_shift(model):
        pos = torch.cat([pos[:, 1:], torch.zeros_like(pos[:, :1])], 1)
    return pos


def _metric_value(metric: Metric, logits: Tensor, target: Tensor, counter: Tensor | None) -> float:
    """Scalar metric on readout logits ``[n, vocab]`` (see module doc)."""
    if callable(metric):
        return float(metric(logits))
    lf = logits.float()
    if metric == "logit_diff":
        return float((lf.gather(-1, target[:, None]) - lf.gather(-1, counter[:, None])).mean())
    lp = lf.log_softmax(-1).gather(-1, target[:, None])
    if metric == "logprob":
        return float(lp.mean())
    if metric == "prob":
        return float(lp.exp().mean())
    raise ValueError(f"unknown metric {metric!r}; expected logit_diff, prob, logprob or a callable")


def _best_other(logits: Tensor, exclude: Tensor, mask_id: int | None) -> Tensor:
    lf = logits.float().clone()
    lf.scatter_(-1, exclude[:, None], -torch.inf)
    if mask_id is not None:
        lf[:, mask_id] = -torch.inf
    return lf.argmax(-1)


def _readout(model: Any, raw: Tensor, committed: Tensor) -> Tensor:
    """Raw logits ``[b, T, vocab]`` → the readout logits of the committed positions ``[n, vocab]``."""
    b_idx, p_idx = committed.nonzero(as_tuple=True)
    return raw[b_idx, p_idx - readout_shift(model)]


# ----------------------------------------------------------------------------------------------
# (a) attention knockout
# ----------------------------------------------------------------------------------------------

class KnockoutHooks:
    """Hooks that set the pre-softmax scores from chosen queries to chosen keys to −inf, per layer.

    ``targets``: "anchors" (detected per forward by a *pre-pass*: the same input run once without the
    knockout, anchors from each layer's unablated attention, head-mean, ``rule``), "random" (as many
    random visible non-anchor keys as there are anchors, per forward and layer), or a list of positions.
    In ``generate`` the input comes from ``model.state``; for a plain forward set ``.tokens`` and
    ``.attention_mask`` first.  Rows whose every visible key would be removed are left unchanged.
    """

    def __init__(self, model: Any, layers: Sequence[int], targets: Any = "anchors", queries: str = "masked",
                 rule: str = "zscore", prompt_length: int = 0, seed: int = 0, **detect_kwargs: Any):
        self.model, self.layers, self.targets, self.queries = model, list(layers), targets, queries
        self.rule, self.prompt_length, self.detect_kwargs = rule, prompt_length, detect_kwargs
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens: Tensor | None = None
        self.attention_mask: Tensor | None = None
        self._prepass = False
        self._anchors: dict[int, Tensor] = {}
        self.n_knocked: dict[int, float] = {}

    @property
    def needs_prepass(self) -> bool:
        return isinstance(self.targets, str)

    def _inputs(self) -> tuple[Tensor, Tensor | None]:
        st = self.model.state
        if st is not None:
            return st.x, st.key_visible.long()
        if self.tokens is None:
            raise RuntimeError("KnockoutHooks outside generate: set .tokens (and .attention_mask) first")
        return self.tokens, self.attention_mask

    def _embed_hook(self, x: Tensor, hook: Any) -> None:
        if self._prepass:
            return
        tokens, am = self._inputs()
        self._rows = _readout_rows(self.model, tokens, self.prompt_length, self.queries)
        if self.needs_prepass:
            self._prepass, self._anchors = True, {}
            try:
                self.model(tokens, attention_mask=am, return_type=None)
            finally:
                self._prepass = False

    def _target_mask(self, layer: int, scores: Tensor) -> Tensor:
        kv = torch.isfinite(scores).any(1).any(1)
        if not self.needs_prepass:
            m = torch.zeros_like(kv)
            m[:, [p for p in self.targets if p < m.shape[1]]] = True
            return m & kv
        anchors = self._anchors[layer]
        return anchors if self.targets == "anchors" else _random_like(anchors, kv, self.gen)

    def _score_hook(self, layer: int):
        def hook(scores: Tensor, hook: Any) -> Tensor | None:
            if self._prepass:
                self._anchors[layer] = anchor_mask_from_scores(scores, self.rule, is_causal(self.model),
                                                               **self.detect_kwargs)[0]
                return None
            t = self._target_mask(layer, scores)
            self.n_knocked[layer] = float(t.sum(-1).float().mean())
            cut = self._rows[:, None, :, None] & t[:, None, None, :]
            new = scores.masked_fill(cut, -torch.inf)
            dead = ~torch.isfinite(new).any(-1, keepdim=True)
            return torch.where(dead, scores, new)
        return hook

    def hooks(self) -> list[tuple[str, Any]]:
        return [("hook_embed", self._embed_hook)] + [
            (f"blocks.{l}.attn.hook_attn_scores", self._score_hook(l)) for l in self.layers]

    def step_hooks(self, step_list: Sequence[int] | None) -> list[tuple[str, Any]]:
        """The hooks bound to denoising steps with ``at_steps`` (None = every step)."""
        if step_list is None:
            return self.hooks()
        return [(n, at_steps(fn, list(step_list))) for n, fn in self.hooks()]


@dataclass
class KnockoutResult(ResultMixin):
    """Metric per condition (clean / knockout / random control), teacher-forced per step on the clean
    trajectory, and agreement / accuracy after full sampling with the knockout bound to the steps."""

    conditions: list[str]
    steps: list[int]
    layers: list[int]
    metric: str
    step_metric: Tensor         # [condition, step]  metric at the positions the clean run committed at s
    metric_mean: Tensor         # [condition]
    n_targets: Tensor           # [condition, step]  mean knocked keys per (row, layer)
    agreement: Tensor           # [condition]  fraction of generated tokens equal to the clean generation
    accuracy: Tensor            # [condition]  answer correctness (NaN without ``answer``)
    notes: list[str] = field(default_factory=list)

    _dims: ClassVar = {"step_metric": ("condition", "step"), "metric_mean": ("condition",),
                       "n_targets": ("condition", "step"), "agreement": ("condition",), "accuracy": ("condition",)}

    def _coords(self):
        return {"condition": self.conditions, "step": self.steps}

    def table(self):
        """Wide summary: one row per condition (metric_mean, agreement, accuracy)."""
        return self.to_frame(metrics=["metric_mean", "agreement", "accuracy"]).pivot(
            index="condition", columns="metric", values="value").loc[self.conditions]


def _conditions(targets: Any, n_random: int) -> list[tuple[str, Any]]:
    if isinstance(targets, str) and targets not in ("anchors", "random"):
        raise ValueError(f"targets must be 'anchors', 'random' or a list of positions, got {targets!r}")
    main = [(targets if isinstance(targets, str) else "targets", targets)]
    if targets != "random" and n_random > 0:
        main.append(("random", "random" if targets == "anchors" else ("random_list", list(targets))))
    return main


def _hooks_for(model: Any, spec: Any, layers: list[int], queries: str, rule: str, P: int, seed: int,
               detect_kwargs: dict) -> KnockoutHooks:
    if isinstance(spec, tuple):   # random control of a fixed list: same count of other visible positions
        _, fixed = spec
        return _RandomListHooks(model, layers, fixed, queries, rule, P, seed, **detect_kwargs)
    return KnockoutHooks(model, layers, spec, queries, rule, P, seed, **detect_kwargs)


class _RandomListHooks(KnockoutHooks):
    """Random control of a fixed target list: as many random visible positions outside the list."""

    def __init__(self, model, layers, fixed, queries, rule, prompt_length, seed, **kw):
        super().__init__(model, layers, list(fixed), queries, rule, prompt_length, seed, **kw)

    def _target_mask(self, layer: int, scores: Tensor) -> Tensor:
        fixed = super()._target_mask(layer, scores)
        kv = torch.isfinite(scores).any(1).any(1)
        return _random_like(fixed, kv, self.gen)


@torch.no_grad()
def _teacher_forced(model: Any, clean: Any, s: int, ko: KnockoutHooks | None, metric: Metric) -> tuple[float, float]:
    """Metric of one step forward on the clean trajectory's input x_s, with or without the knockout."""
    x, am = step_canvas(clean, s)
    committed = clean.trajectory.commit_step.to(x.device) == s
    target = clean.tokens[committed]
    if ko is None:
        raw, n = model(x, attention_mask=am), 0.0
    else:
        ko.tokens, ko.attention_mask, ko.n_knocked = x, am, {}
        raw = model.run_with_hooks(x, attention_mask=am, fwd_hooks=ko.hooks())
        n = float(np.mean(list(ko.n_knocked.values()))) if ko.n_knocked else 0.0
    logits = _readout(model, raw, committed)
    return _metric_value(metric, logits, target, _best_other(logits, target, model.cfg.mask_token_id)), n


def knockout(model: Any, prompt_ids: Any, *, steps: Sequence[int] | None = None, layers: Sequence[int] | None = None,
             targets: Any = "anchors", queries: Literal["masked", "all", "answer"] = "masked", rule: str = "zscore",
             n_random: int = 3, seed: int = 0, metric: Metric = "logit_diff", answer: Any = None,
             gen_length: int | None = None, n_steps: int | None = None, decode: Any = None,
             **generate_kwargs: Any) -> KnockoutResult:
    """Attention knockout of anchors (Rulli's sink masking; Geva's edge blocking) at chosen steps/layers.

    At each step in ``steps`` (None = all) and layer in ``layers`` (None = all), scores
    ``A_pre[i, j] := −inf`` for queries i in ``queries`` and keys j in the targets (see
    :class:`KnockoutHooks`).  Conditions: ``clean``; the targets; ``random`` (``n_random`` draws of the
    same count of non-target visible keys, averaged).  Reported per condition: (1) the metric at the
    positions the clean run committed at step s, from one forward on the clean input x_s
    (teacher-forced); (2) after full sampling with the knockout bound to ``steps`` (``at_steps``):
    agreement with the clean generation and, given ``answer`` (text or ids), accuracy.
    """
    dev = model.W_E.device
    prompt = _batch(prompt_ids, dev)
    g = int(gen_length or model.cfg.extra.get("gen_length", 4))
    ns = g if is_causal(model) else (n_steps or g)
    ls = layer_list(model, layers)
    chosen = Steps(tuple(steps)).resolve(ns) if steps is not None else None
    step_list = sorted(chosen) if chosen is not None else list(range(ns))
    gen = lambda hooks=(): model.generate(prompt, steps=ns, gen_length=g, fwd_hooks=hooks, **generate_kwargs)  # noqa: E731
    clean = gen()

    def one_draw(spec: Any, d: int) -> tuple[list[float], list[float], float, float]:
        """(metric per step, knocked keys per step, agreement, accuracy) of one condition draw."""
        ko = None if spec is None else _hooks_for(model, spec, ls, queries, rule, prompt.shape[1], seed + d, {})
        vals = [_teacher_forced(model, clean, s, ko, metric) for s in step_list]
        out = clean if ko is None else gen(ko.step_hooks(chosen and step_list))
        agree = float((out.generated == clean.generated).float().mean())
        acc = (float(np.mean([answer_correct(model, r.cpu(), answer, decode) for r in out.generated]))
               if answer is not None else math.nan)
        return [v[0] for v in vals], [v[1] for v in vals], agree, acc

    names, sm, nt, agree, acc = [], [], [], [], []
    for name, spec in [("clean", None)] + _conditions(targets, n_random):
        draws = [one_draw(spec, d) for d in range(n_random if name == "random" else 1)]
        names.append(name)
        for store, i in ((sm, 0), (nt, 1), (agree, 2), (acc, 3)):
            store.append(np.mean([dr[i] for dr in draws], 0))
    sm_t = torch.tensor(np.array(sm), dtype=torch.float64)
    return KnockoutResult(conditions=names, steps=step_list, layers=ls, metric=metric if isinstance(metric, str) else
                          getattr(metric, "__name__", "custom"), step_metric=sm_t, metric_mean=sm_t.nanmean(-1),
                          n_targets=torch.tensor(np.array(nt), dtype=torch.float64),
                          agreement=torch.tensor(agree, dtype=torch.float64),
                          accuracy=torch.tensor(acc, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# (b) activation patching at anchor positions
# ----------------------------------------------------------------------------------------------

@dataclass
class PatchingResult(ResultMixin):
    """Noising patch (corrupted → clean run) at a step, per layer and position set.

    normalised = (LD − LD_corr) / (LD_clean − LD_corr): 1 = the patch changes nothing (the positions are
    not necessary), 0 = as bad as the fully corrupted input."""

    step: int
    component: str
    layers: list[int]
    conditions: list[str]
    metric: str
    clean_value: float
    corrupt_value: float
    value: Tensor               # [condition, layer]
    normalised: Tensor          # [condition, layer]
    n_positions: Tensor         # [condition, layer]  mean patched positions per row
    notes: list[str] = field(default_factory=list)

    _dims: ClassVar = {"value": ("condition", "layer"), "normalised": ("condition", "layer"),
                       "n_positions": ("condition", "layer")}

    def _coords(self):
        return {"condition": self.conditions, "layer": self.layers}

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
        if positions != "anchors":
            raise ValueError(f"positions must be 'anchors' or a list of positions, got {positions!r}")
        base, name = anchors, "anchors"
    else:
        base = torch.zeros_like(kv)
        base[:, list(positions)] = True
        base, name = base & kv, "positions"
    return [(name, base)] + [(f"random{i}" if n_random > 1 else "random", _random_like(base, kv, gen))
                             for i in range(n_random)]


@torch.no_grad()
def patch_anchor_activations(model: Any, clean_ids: Any, corrupt_ids: Any, *, step: int = 0,
                             layers: Sequence[int] | None = None,
                             component: Literal["resid_pre", "k", "v"] = "resid_pre", positions: Any = "anchors",
                             metric: Metric = "logit_diff", tokens: tuple[int, int] | None = None,
                             rule: str = "zscore", n_random: int = 1, seed: int = 0, gen_length: int | None = None,
                             n_steps: int | None = None, **generate_kwargs: Any) -> PatchingResult:
    """Patch corrupted activations at anchor positions into the clean run, layer by layer (noising, §2.10).

    The clean prompt is sampled; at ``step`` the clean input x_s is taken from the trajectory and the
    corrupted input is x_s with its prompt replaced by ``corrupt_ids`` (same length: symmetric token
    replacement).  For each layer l, ``component`` (``blocks.l.hook_resid_pre``, ``attn.hook_k`` or
    ``attn.hook_v``) of the corrupted forward replaces the clean one at the positions: ``"anchors"`` =
    the clean step forward's layer-l anchors (head-mean, ``rule``), or a fixed list; plus ``n_random``
    random controls of the same count.  Metric at the positions committed at s (default logit diff,
    correct = clean committed token, counterfactual = ``tokens[1]`` or the corrupted forward's best
    other token), normalised (LD − LD_corr)/(LD_clean − LD_corr).
    """
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {tuple(COMPONENTS)}, got {component!r}")
    dev = model.W_E.device
    clean_p, corrupt_p = _batch(clean_ids, dev), _batch(corrupt_ids, dev)
    if clean_p.shape != corrupt_p.shape:
        raise ValueError(f"clean {tuple(clean_p.shape)} and corrupted {tuple(corrupt_p.shape)} prompts must have the "
                         "same shape (symmetric token replacement)")
    g = int(gen_length or model.cfg.extra.get("gen_length", 4))
    ns = g if is_causal(model) else (n_steps or g)
    clean = model.generate(clean_p, steps=ns, gen_length=g, **generate_kwargs)
    s = step % ns
    x, am = step_canvas(clean, s)
    xc = x.clone()
    xc[:, : clean_p.shape[1]] = corrupt_p
    committed = clean.trajectory.commit_step.to(dev) == s
    if not bool(committed.any()):
        raise ValueError(f"no position was committed at step {s}; choose another step")
    ls = layer_list(model, layers)
    names = [COMPONENTS[component].format(l=l) for l in ls]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in ls]
    raw_c, cache_c = model.run_with_cache(x, attention_mask=am, names_filter=scores)
    raw_x, cache_x = model.run_with_cache(xc, attention_mask=am, names_filter=names)
    target = clean.tokens[committed] if tokens is None else torch.full_like(clean.tokens[committed], tokens[0])
    ro_c, ro_x = _readout(model, raw_c, committed), _readout(model, raw_x, committed)
    counter = (_best_other(ro_x, target, model.cfg.mask_token_id) if tokens is None
               else torch.full_like(target, tokens[1]))
    v_clean, v_corr = (_metric_value(metric, r, target, counter) for r in (ro_c, ro_x))
    gen = torch.Generator().manual_seed(seed)
    table: dict[str, list[tuple[float, float]]] = {}
    for l, name, sc in zip(ls, names, scores):
        anchors, kv = anchor_mask_from_scores(cache_c[sc], rule, is_causal(model))
        for cond, mask in _position_sets(positions, anchors, kv, gen, n_random):
            raw = model.run_with_hooks(x, attention_mask=am, fwd_hooks=[(name, _patch_hook(cache_x[name], mask))])
            table.setdefault(cond, []).append((_metric_value(metric, _readout(model, raw, committed), target, counter),
                                               float(mask.sum(-1).float().mean())))
    conds = list(table)
    value = torch.tensor([[v for v, _ in table[c]] for c in conds], dtype=torch.float64)
    denom = v_clean - v_corr
    notes = [] if abs(denom) > 1e-12 else ["clean and corrupted metrics are equal: normalised is NaN"]
    norm = (value - v_corr) / denom if not notes else torch.full_like(value, torch.nan)
    return PatchingResult(step=s, component=component, layers=ls, conditions=conds,
                          metric=metric if isinstance(metric, str) else getattr(metric, "__name__", "custom"),
                          clean_value=v_clean, corrupt_value=v_corr, value=value, normalised=norm,
                          n_positions=torch.tensor([[n for _, n in table[c]] for c in conds], dtype=torch.float64),
                          notes=notes)
