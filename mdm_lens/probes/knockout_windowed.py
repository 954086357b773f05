"""Knockout on the samplers whose forwards a replay does not rebuild: Nemotron-Labs-Diffusion (`sampler="nemotron"`)
and BD3LM (`sampler="bd3lm"`), read from the sampled runs themselves.

* Steps: step k is the k-th *denoising forward* of the run (:mod:`mdm_lens.diffusion.own_forwards`): nemotron's
  "denoise" forwards (not its causal prefill / commit forwards), bd3lm's forwards computing p(x0) of a block (not
  the storing forward of ``kv_cache=True``). The grid has :func:`max_denoising_forwards` entries; a grid step the
  run never reached cut nothing (``n_targets`` NaN, noted). ``steps=[k]`` cuts exactly that forward
  (``forwards_cut`` counts the forwards each condition cut).
* Queries and keys: the forward's own rows (absolute positions ``state.rows``) and keys (``state.keys``: the KV
  cache's and the window's); "anchors" / "random" come from a pre-pass that re-runs the very forward unablated.
* Metrics, sampled with the knockout on: ``answer_logprob`` / ``answer_rank`` read, for each answer position, from
  the forward whose logits committed it in that run — the denoising forward that computed its row (bd3lm: the
  latest one when p(x0) was reused), or for nemotron's block seeds the causal forward's last logit (the AR token
  it drew) — plus ``exact_match``, ``agreement``, ``accuracy``.
* Not applicable (NaN, with a note): the teacher-forced metrics and the per-step committed metric, which re-run a
  step's forward with the gold placed in the canvas; these windowed, KV-cached forwards have no such re-run without
  a replay of the sampler's own forward.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mdm_lens.diffusion.own_forwards import OWN_FORWARDS, is_denoising_forward, max_denoising_forwards

from . import _causal as C
from ._knockout_hooks import _GoldScorer, readout, readout_hook
from .knockout_bd import cut_forwards, sampled_knockout

NOT_APPLICABLE = ("teacher-forced metrics (tf_*) and the per-step committed metric are NaN on sampler={sampler!r}: "
                  "they re-run a step's forward with the gold answer placed in the canvas, and {why}")
WHY_NOT = {"nemotron": "nemotron's denoising forwards read the KV cache an earlier causal forward filled (the prompt "
                       "reaches a block only through it), which a re-run of the canvas does not rebuild",
           "bd3lm_kv": "BD3LM's kv_cache forwards read the stored keys / values of the finished blocks, which a "
                       "re-run of the canvas does not rebuild",
           "bd3lm": "that re-run is not built for BD3LM's windows at the step's noise level (patching and attribution "
                    "patching do run a window that starts at 0; knockout reports its sampled metrics only)"}


def not_applicable(sampler: str, generate_kwargs: dict) -> str:
    """Why knockout's teacher-forced metrics are NaN on this windowed run (the reason true for its settings)."""
    key = "bd3lm_kv" if sampler == "bd3lm" and generate_kwargs.get("kv_cache") else sampler
    return NOT_APPLICABLE.format(sampler=sampler, why=WHY_NOT[key])


class ForwardSteps:
    """Numbers the run's denoising forwards in the order they ran (run step → knockout step) and gates hooks to the
    chosen ones."""

    def __init__(self, model: Any, chosen: list[int] | None):
        self.model, self.chosen = model, None if chosen is None else set(chosen)
        self.ordinal_of: dict[int, int] = {}   # run step → knockout step

    def ordinal(self) -> int | None:
        st = self.model.state
        if not is_denoising_forward(st):
            return None
        return self.ordinal_of.setdefault(st.step, len(self.ordinal_of))

    def gate(self, fn: Any) -> Any:
        def gated(x: Tensor, hook: Any) -> Any:
            k = self.ordinal()
            if k is None or (self.chosen is not None and k not in self.chosen):
                return None
            return fn(x, hook)
        return gated


class WindowGoldScorer(_GoldScorer):
    """On the readout hook of each forward: log-prob and rank of the gold token at the absolute positions the
    forward's logits decide — a denoising forward's rows (``state.rows``), or the position after a nemotron causal
    forward (its last logit draws the next block's seed). Keyed by run step."""

    def __call__(self, act: Tensor, hook: Any) -> None:
        st = self.model.state
        if st is None or st.phase != "cond" or st.extra.get("kv_store", False):
            return  # a storing forward commits nothing
        raw = C.check_logits(readout(self.model, act), f"step {st.step}")
        lp, rank = (torch.full(self.gold.shape, math.nan, dtype=torch.float64) for _ in range(2))
        if is_denoising_forward(st):
            q0 = st.rows.start
            got = C.gold_scores(self.model, raw, self.gold[:, q0:q0 + raw.shape[1]].to(raw.device))
            lp[:, q0:q0 + raw.shape[1]], rank[:, q0:q0 + raw.shape[1]] = (t.cpu() for t in got)
        elif st.rows.stop < self.gold.shape[1]:  # nemotron prefill / commit: logit -1 drew the token at rows.stop
            p = st.rows.stop
            got = C.gold_scores(self.model, raw[:, -1:], self.gold[:, p:p + 1].to(raw.device))
            lp[:, p:p + 1], rank[:, p:p + 1] = (t.cpu() for t in got)
        self.lp[st.step], self.rank[st.step] = lp, rank

    def at_commit(self, commit_step: Tensor) -> tuple[Tensor, Tensor]:
        """Scores at each position's commit step, read from the latest scored forward at or before it (a bd3lm step
        that reused p(x0) ran no forward: its commits come from that earlier forward's logits)."""
        lp = torch.full(self.gold.shape, math.nan, dtype=torch.float64)
        rank = lp.clone()
        cs = commit_step.cpu()[:, : self.gold.shape[1]]
        if cs.shape[1] < self.gold.shape[1]:  # a run shorter than the gold canvas (it stopped early): never committed
            cs = torch.cat([cs, cs.new_full((cs.shape[0], self.gold.shape[1] - cs.shape[1]), -1)], 1)
        scored = sorted(self.lp)
        for s in sorted(set(cs[cs >= 0].tolist())):
            before = [f for f in scored if f <= s]
            if before:
                at = cs == s
                lp[at], rank[at] = self.lp[before[-1]][at], self.rank[before[-1]][at]
        return lp, rank


class _WindowDraw:
    """One condition run on nemotron / bd3lm: the knockout gated to the chosen denoising forwards, the scorer."""

    def __init__(self, model: Any, gold: Tensor, ko: Any, chosen: list[int] | None):
        self.ko, self.steps, self.scorer = ko, ForwardSteps(model, chosen), WindowGoldScorer(model, gold)
        cut = [] if ko is None else [(n, self.steps.gate(fn)) for n, fn in ko.hooks()]
        # the scorer numbers the forwards too, so an uncut condition knows which run steps were denoising forwards
        self.hooks = cut + [(readout_hook(model), self._score)]

    def _score(self, act: Tensor, hook: Any) -> None:
        self.steps.ordinal()
        self.scorer(act, hook)

    def n_targets(self, step_list: list[int]) -> list[float]:
        """Mean keys cut per (row, layer) at each grid step; NaN at a step the run never reached."""
        by = {} if self.ko is None else self.ko.knocked_by_step
        reached = {k: s for s, k in self.steps.ordinal_of.items()}
        return [math.nan if k not in reached else float(np.mean(by[reached[k]])) if reached[k] in by else 0.0
                for k in step_list]

    def n_cut(self) -> int:
        return cut_forwards(self.ko)


def grid_size(model: Any, sampler: str, prompt_length: int, g: int, ns: int) -> int:
    bs = getattr(model.cfg, "extra", {}).get("block_size", 1)
    return max_denoising_forwards(sampler, dict(gen_length=g, steps=ns, block_size=bs), prompt_length)


def knockout_windowed(model: Any, prompt: Tensor, sampler: str, **kw: Any) -> dict:
    """The per-condition numbers of :func:`mdm_lens.probes.knockout.knockout` on nemotron / bd3lm (module
    docstring); notes the step meaning, the teacher-forced metrics' NaN and grid steps no condition reached."""
    r = sampled_knockout(model, prompt, draw=_WindowDraw, notes=[
        f"sampler={sampler!r}: {OWN_FORWARDS[sampler]}", not_applicable(sampler, kw.get("generate_kwargs", {}))],
        **kw)
    nt = np.array([p["nt"] for p in r["per"]], dtype=float)
    never = [k for k, col in zip(kw["step_list"], nt.T) if np.isnan(col).all()]
    if never:
        r["notes"].append(f"steps {never} were not reached (every condition's run ended before its denoising "
                          f"forward {min(never)}): nothing was cut there, n_targets NaN")
    return r
