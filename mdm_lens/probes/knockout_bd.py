"""Anchor knockout on a block-diffusion model (DiffusionGemma through the bridge): the sampled metrics of
:func:`mdm_lens.probes.knockout.knockout`, with DiffusionGemma's meaning of every piece.

* Queries: the canvas rows of each denoiser pass — ``"masked"`` = not yet accepted at that step, ``"all"`` /
  ``"answer"`` = every canvas row. Keys: every position that exists (prompt, earlier canvases, the canvas).
* Targets ``"anchors"`` / ``"random"``: detected per denoiser pass on a *pre-pass* of the same step — the
  sampler's own decoder call (same KV cache, self-conditioning and mask, ``state.extra["rerun"]``) run once
  without the knockout — as LLaDA's knockout re-runs the step's input. A list: fixed absolute positions.
  The cut itself is :class:`mdm_lens.probes.knockout.KnockoutHooks`, shared with LLaDA/Dream.
* Metrics, sampled with the knockout on: ``answer_logprob`` / ``answer_rank`` (the gold token read from the
  softcapped logits of the pass that accepted each answer position in that run), ``exact_match``,
  ``agreement`` (positions equal to the clean run's, over the clean run's length) and ``accuracy``.
* Not applicable (NaN, with a note): the teacher-forced metrics and the per-step committed metric — they place
  the gold into a *masked* canvas, and a DiffusionGemma canvas is uniform noise, not masks.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from mdm_lens import validate

from . import _causal as C
from ._knockout_hooks import _answer_totals, _exact_match, _GoldScorer, _hooks_for
from .retrieval import answer_correct

NOT_APPLICABLE = ("teacher-forced metrics (tf_*) and the per-step committed metric do not apply to a block-diffusion "
                  "model: they place the gold into a masked canvas, and DiffusionGemma's canvas is uniform noise")


class CanvasGoldScorer(_GoldScorer):
    """On ``ln_final.hook_out`` of each denoiser pass: log-prob and rank of the gold token at the canvas's
    positions, from the logits transformers computes there (``lm_head``, fp32, final softcapping)."""

    def __call__(self, x: Tensor, hook: Any) -> None:
        st = self.model.state
        if st is None or st.phase != "cond":
            return
        logits = C.check_logits(self.model.final_logits(x), f"denoising step {st.step}")     # [b, canvas, vocab]
        start = int(st.extra["canvas_start"])
        gold = self.gold[:, start:start + logits.shape[1]].to(logits.device)
        lp = torch.full(self.gold.shape, math.nan, dtype=torch.float64)
        rank = lp.clone()
        have = gold >= 0
        g = gold.clamp_min(0)
        own = logits.gather(-1, g[..., None])
        canvas_lp = (torch.log_softmax(logits.double(), -1).gather(-1, g[..., None]))[..., 0]
        canvas_rank = (logits > own).sum(-1).double()
        lp[:, start:start + logits.shape[1]] = torch.where(have, canvas_lp, math.nan).cpu()
        rank[:, start:start + logits.shape[1]] = torch.where(have, canvas_rank, math.nan).cpu()
        self.lp[st.step], self.rank[st.step] = lp, rank

    def at_commit(self, commit_step: Tensor) -> tuple[Tensor, Tensor]:
        lp = torch.full(self.gold.shape, math.nan, dtype=torch.float64)
        rank = lp.clone()
        cs = commit_step.cpu()[:, : self.gold.shape[1]]
        for s in self.lp:
            at = torch.zeros_like(lp, dtype=torch.bool)
            at[:, : cs.shape[1]] = cs == s
            lp[at], rank[at] = self.lp[s][at], self.rank[s][at]
        return lp, rank


def _agreement(out: Any, clean: Any) -> float:
    a, b = clean.generated.cpu(), out.generated.cpu()
    n = a.shape[1]
    if b.shape[1] < n:  # a run that stopped earlier disagrees on the positions it never generated
        b = torch.cat([b, b.new_full((b.shape[0], n - b.shape[1]), -1)], 1)
    return float((b[:, :n] == a).float().mean())


class _CanvasDraw:
    """One DiffusionGemma condition run: the knockout bound to run steps, the canvas scorer on each denoiser pass."""

    def __init__(self, model: Any, gold: Tensor, ko: Any, chosen: list[int] | None):
        self.ko, self.scorer = ko, CanvasGoldScorer(model, gold)
        self.hooks = ([] if ko is None else ko.step_hooks(chosen)) + [("ln_final.hook_out", self.scorer)]

    def n_targets(self, step_list: list[int]) -> list[float]:
        by = {} if self.ko is None else self.ko.knocked_by_step
        return [float(np.mean(by[s])) if s in by else 0.0 for s in step_list]

    def n_cut(self) -> int:
        return cut_forwards(self.ko)


def cut_forwards(ko: Any) -> int:
    """The forwards in which the knockout removed at least one key (at some layer): a hooked forward whose
    condition found no target (no anchor passed the rule) ran but cut nothing, and is not counted."""
    return 0 if ko is None else sum(max(v) > 0 for v in ko.knocked_by_step.values())


def _unchanged(scores: Tensor, hook: Any) -> None:
    """A hook that leaves the scores as they are (it only makes the attention take its explicit path)."""


def knockout_block_diffusion(model: Any, prompt: Tensor, **kw: Any) -> dict:
    """The per-condition numbers of :func:`knockout` on a block-diffusion model (see the module docstring)."""
    return sampled_knockout(model, prompt, draw=_CanvasDraw, notes=[NOT_APPLICABLE], **kw)


def sampled_knockout(model: Any, prompt: Tensor, *, draw: Any, notes: list[str], step_list: list[int],
                     chosen: list[int] | None, layers: list[int], targets: Any, queries: str, rule: str,
                     n_random: int, seed: int, metric: Any, answer: Any, offset: int, g: int, ns: int, decode: Any,
                     conditions: list[tuple[str, Any]], generate_kwargs: dict) -> dict:
    """Knockout read from the sampled runs alone (no teacher-forced forward): per condition, ``model.generate`` with
    the knockout and a gold scorer, both from ``draw(model, gold, ko, chosen)`` (its ``hooks``, ``scorer`` with
    ``at_commit``, ``n_targets(step_list)``, ``n_cut()``). The clean run goes through the same path, so a knockout
    that cuts nothing equals it exactly. Used by DiffusionGemma and by the samplers of
    :mod:`mdm_lens.diffusion.own_forwards` (nemotron, bd3lm)."""
    validate.choice(metric, ("answer_logprob", "answer_rank", "exact_match"), name="metric")

    def gen(hooks: Sequence[Any] = ()) -> Any:
        return model.generate(prompt, gen_length=g, steps=ns, fwd_hooks=list(hooks), **generate_kwargs)

    # every condition, clean included, takes the attention's explicit path (a hook on the scores forces it; unhooked,
    # SDPA runs): so a knockout that cuts nothing equals clean exactly, not to kernel rounding
    explicit = [(f"blocks.{l}.attn.hook_attn_scores", _unchanged) for l in layers]
    clean = gen(explicit)
    P = prompt.shape[1]
    if answer is None:
        gold_ids, source = C.clean_answer(model, clean.generated.cpu(), offset), "clean generation"
    else:
        gold_ids, source = C.gold_answer(model, answer, prompt.shape[0], clean.generated.shape[1], offset), "answer"
    gold = C.gold_grid(gold_ids, P, clean.tokens.shape[1], offset, "cpu")
    have = gold >= 0
    per, names = [], []
    for name, spec in [("clean", None)] + conditions:
        draws = []
        for d in range(n_random if name == "random" else 1):
            ko = None if spec is None else _hooks_for(model, spec, layers, queries, rule, P, seed + d)
            run = draw(model, gold, ko, chosen)
            out = gen(run.hooks + (explicit if ko is None else []))
            lp, rk = run.scorer.at_commit(out.trajectory.commit_step)
            a_lp, a_rank = _answer_totals(lp, rk, have)
            acc = (float(np.mean([answer_correct(model, r.cpu(), answer, decode) for r in out.generated]))
                   if answer is not None else math.nan)
            draws.append(dict(answer_logprob=a_lp, answer_rank=a_rank, agreement=_agreement(out, clean),
                              exact_match=_exact_match(model, out, gold_ids, answer, offset, decode), accuracy=acc,
                              nt=run.n_targets(step_list), forwards_cut=run.n_cut(),
                              unmatched=0 if ko is None else ko.unmatched,
                              kept=0 if ko is None else sum(ko.rows_kept.values())))
        names.append(name)
        per.append({k: np.mean([dr[k] for dr in draws], 0) for k in draws[0]})
    return dict(names=names, per=per, gold_ids=gold_ids, source=source, notes=list(notes))
