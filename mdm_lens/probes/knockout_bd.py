"""Anchor knockout on a block-diffusion model (DiffusionGemma through the bridge): the sampled metrics of
:func:`mdm_lens.probes.knockout.knockout`, with DiffusionGemma's meaning of every piece.

* Queries: the canvas rows of each denoiser pass — ``"masked"`` = not yet accepted at that step, ``"all"`` /
  ``"answer"`` = every canvas row. Keys: every position that exists (prompt, earlier canvases, the canvas).
* Targets ``"anchors"`` / ``"random"``: detected per denoiser pass on a *pre-pass* of the same step — the
  sampler's own decoder call (same KV cache, self-conditioning and mask, ``state.extra["rerun"]``) run once
  without the knockout — as LLaDA's knockout re-runs the step's input. A list: fixed absolute positions.
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
from .knockout import _answer_totals, _exact_match, _GoldScorer
from .retrieval import answer_correct

NOT_APPLICABLE = ("teacher-forced metrics (tf_*) and the per-step committed metric do not apply to a block-diffusion "
                  "model: they place the gold into a masked canvas, and DiffusionGemma's canvas is uniform noise")


def visible_keys(scores: Tensor) -> Tensor:
    """[batch, key]: keys some query may attend (masked scores are −inf or the dtype's minimum)."""
    return (scores > torch.finfo(scores.dtype).min).any(1).any(1)


class CanvasKnockout:
    """Score hooks that cut chosen canvas queries → chosen keys on the decoder layers, in DiffusionGemma's sampler."""

    def __init__(self, model: Any, layers: Sequence[int], targets: Any, queries: str, rule: str, seed: int):
        self.model, self.layers, self.targets, self.queries, self.rule = model, list(layers), targets, queries, rule
        self.gen = torch.Generator().manual_seed(seed)
        self._prepass, self._anchors = False, {}
        self.knocked: dict[int, list[float]] = {}          # step → keys removed per (row, layer), each pass

    def _embed_hook(self, x: Tensor, hook: Any) -> None:
        st = self.model.state
        if self._prepass or st is None or st.phase != "cond":
            return
        self._rows = st.masked.clone() if self.queries == "masked" else torch.ones_like(st.masked)
        if isinstance(self.targets, str):
            self._prepass, self._anchors = True, {}
            try:
                st.extra["rerun"]()
            finally:
                self._prepass = False

    def _targets(self, layer: int, scores: Tensor) -> Tensor:
        kv = visible_keys(scores)
        if not isinstance(self.targets, str):
            fixed = self.targets[1] if isinstance(self.targets, tuple) else self.targets   # ("random_list", [...])
            t = torch.zeros_like(kv)
            t[:, [p for p in fixed if p < t.shape[1]]] = True
            # the random control of a list: as many other visible keys
            return C.random_like(t & kv, kv, self.gen) if isinstance(self.targets, tuple) else t & kv
        anchors = self._anchors[layer]
        return anchors if self.targets == "anchors" else C.random_like(anchors, kv, self.gen)

    def _score_hook(self, layer: int):
        def hook(scores: Tensor, hook: Any) -> Tensor | None:
            st = self.model.state
            if st is None or st.phase != "cond":
                return None
            if self._prepass:
                self._anchors[layer] = C.anchor_mask_from_scores(scores, self.rule, False)[0]
                return None
            t = self._targets(layer, scores)
            self.knocked.setdefault(st.step, []).append(float(t.sum(-1).float().mean()))
            cut = self._rows[:, None, :, None] & t[:, None, None, :]
            new = scores.masked_fill(cut, -torch.inf)
            dead = ~torch.isfinite(new).any(-1, keepdim=True)
            return torch.where(dead, scores, new)
        return hook

    def hooks(self, step_list: Sequence[int] | None) -> list[tuple[str, Any]]:
        from mdm_lens.hooks import at_steps

        pairs = [("hook_embed", self._embed_hook)] + [
            (f"blocks.{l}.attn.hook_attn_scores", self._score_hook(l)) for l in self.layers]
        return pairs if step_list is None else [(n, at_steps(fn, list(step_list))) for n, fn in pairs]


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


def knockout_block_diffusion(model: Any, prompt: Tensor, *, step_list: list[int], chosen: list[int] | None,
                             layers: list[int], targets: Any, queries: str, rule: str, n_random: int, seed: int,
                             metric: Any, answer: Any, offset: int, g: int, ns: int, decode: Any,
                             conditions: list[tuple[str, Any]], generate_kwargs: dict) -> dict:
    """The per-condition numbers of :func:`knockout` on a block-diffusion model (see the module docstring)."""
    validate.choice(metric, ("answer_logprob", "answer_rank", "exact_match"), name="metric")

    def gen(hooks: Sequence[Any] = ()) -> Any:
        return model.generate(prompt, gen_length=g, steps=ns, fwd_hooks=list(hooks), **generate_kwargs)

    clean = gen()
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
            scorer = CanvasGoldScorer(model, gold)
            ko = None if spec is None else CanvasKnockout(model, layers, spec, queries, rule, seed + d)
            hooks = ([] if ko is None else ko.hooks(chosen)) + [("ln_final.hook_out", scorer)]
            out = gen(hooks)
            lp, rk = scorer.at_commit(out.trajectory.commit_step)
            a_lp, a_rank = _answer_totals(lp, rk, have)
            acc = (float(np.mean([answer_correct(model, r.cpu(), answer, decode) for r in out.generated]))
                   if answer is not None else math.nan)
            nt = [float(np.mean(ko.knocked[s])) if ko is not None and s in ko.knocked else 0.0 for s in step_list]
            draws.append(dict(answer_logprob=a_lp, answer_rank=a_rank, agreement=_agreement(out, clean),
                              exact_match=_exact_match(model, out, gold_ids, answer, offset, decode), accuracy=acc,
                              nt=nt))
        names.append(name)
        per.append({k: np.mean([dr[k] for dr in draws], 0) for k in draws[0]})
    return dict(names=names, per=per, gold_ids=gold_ids, source=source, notes=[NOT_APPLICABLE])
