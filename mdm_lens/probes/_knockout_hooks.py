"""Knockout, shared part: the attention-knockout hooks, the gold-answer scorer and the answer metrics. Why a
module of its own: both the sampler-step probe (`knockout`) and its block-diffusion route (`knockout_bd`) use
them, and `knockout` dispatches to `knockout_bd`, so they cannot live in either."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import InputError
from mdm_lens.hooks import at_steps

from . import _causal as C
from ._results import ResultMixin
from ._runtools import is_block_diffusion
from .retrieval import _decode, answer_correct
from .run import is_causal, step_canvas, step_forward_kwargs


class KnockoutHooks:
    """Hooks that set the pre-softmax scores from chosen queries to chosen keys to −inf, per layer.

    ``targets``: "anchors" (detected per forward by a *pre-pass*: the same input run once without the
    knockout, anchors from each layer's unablated attention, head-mean, ``rule``), "random" (as many
    random visible non-anchor keys as there are anchors, per forward and layer), or a list of positions.
    ``queries``: "masked" (the readout rows of still-masked positions), "all", or "answer" (the readout
    rows of the canvas).  In ``generate`` the input comes from ``model.state``; for a plain forward set
    ``.tokens`` and ``.attention_mask`` first.  Rows whose every visible key would be removed are left
    unchanged (counted in ``rows_kept[layer]``; ``knockout`` notes them).  A random control with fewer other
    visible keys than targets cuts fewer (counted in ``unmatched``; ``knockout`` flags the row).
    ``n_knocked[layer]`` is the mean number of keys removed per row at the last forward;
    ``knocked_by_step[step]`` the same for every pass of a ``generate``.  On a block-diffusion model
    (DiffusionGemma) the rows are the canvas (``"masked"`` = not yet accepted: holding noise in the step's input, ``state.extra["noised"]``) and the pre-pass re-runs the
    sampler's own decoder call (``state.extra["rerun"]``); masked keys may be −inf or the dtype's minimum.
    Block samplers (llada2, sdar, fastdllm_v2): the pre-pass is the canvas up to the forward's end under its block
    mask, without a KV cache; in ``out.replay`` the rows are the replay's (``state.extra["replay_rows"]``). A
    fastdllm_v2 ``use_block_cache=True`` run is refused for "anchors"/"random" (its sub-block forwards read stale
    cached keys that no pre-pass re-runs). Windowed forwards (nemotron's KV-cached blocks, bd3lm's block windows):
    the pre-pass is the forward itself re-run unablated (`state.extra["forward_call"]`), rows start at
    `state.rows.start`, fixed targets are absolute positions mapped onto the forward's keys (`state.keys`).
    """

    def __init__(self, model: Any, layers: Sequence[int], targets: Any = "anchors", queries: str = "masked",
                 rule: str = "zscore", prompt_length: int = 0, seed: int = 0, **detect_kwargs: Any):
        self.model, self.queries = model, validate.choice(queries, C.QUERIES, name="queries")
        self.layers = validate.indices(list(layers), model.cfg.n_layers, name="layers")
        if isinstance(targets, str):
            validate.choice(targets, ("anchors", "random"), name="targets")
        else:
            targets = validate.indices(targets, model.cfg.n_ctx, name="targets", allow_empty=True)  # []: a no-op
        self.targets, self.rule, self.detect_kwargs = targets, rule, detect_kwargs
        self.prompt_length = validate.integer(prompt_length, name="prompt_length", min=0)
        self.gen = torch.Generator().manual_seed(validate.seed(seed, min=None))
        self.tokens: Tensor | None = None
        # outside generate: what makes the pre-pass the forward being cut (a block run's block length, step_canvas)
        self.forward_kwargs: dict = {}
        self.attention_mask: Tensor | None = None
        self._prepass = False
        self._anchors: dict[int, Tensor] = {}
        self.n_knocked: dict[int, float] = {}
        self.knocked_by_step: dict[int, list[float]] = {}   # in generate: step → keys removed per (row, layer)
        self.unmatched = 0  # random controls: (forward, layer) cuts smaller than the targets' count
        self.rows_kept: dict[int, int] = {}   # query rows (batch × head × row) left uncut: every visible key a target
        self._wanted: Tensor | None = None

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

    def _rows_and_rerun(self) -> tuple[Tensor, Any]:
        """The query rows to cut and how to re-run this forward unablated (the anchors' pre-pass).

        Block diffusion (DiffusionGemma): the rows are the canvas (``"masked"`` = not yet accepted) and the
        re-run is the sampler's own decoder call of this step (same KV cache, self-conditioning and mask)."""
        st = self.model.state
        if is_block_diffusion(self.model):
            if st is None or "rerun" not in st.extra:
                raise InputError("KnockoutHooks on a block-diffusion model run inside its generate (a denoiser "
                                 "pass needs the step's KV cache and self-conditioning).", argument="model",
                                 value=self.model.cfg.model_name, allowed="hooks passed to model.generate")
            noised = st.extra.get("noised", st.masked)  # the canvas rows holding noise (not yet accepted)
            rows = noised.clone() if self.queries == "masked" else torch.ones_like(noised)
            return rows, st.extra["rerun"]
        tokens, am = self._inputs()
        rows = C.readout_rows(self.model, tokens, self.prompt_length, self.queries)
        if st is not None and "query_end" in st.extra:  # a block sampler's forward (llada2, sdar, fastdllm_v2)
            if self.needs_prepass and st.extra.get("block_cache") is not None:
                # a sub-block forward reads the block's cache, filled at an earlier forward: no prefix forward equals it
                raise InputError("KnockoutHooks(targets='anchors'/'random') on a fastdllm_v2 use_block_cache=True run "
                                 "(its sub-block forwards read stale cached keys, so no pre-pass can re-run them).",
                                 argument="targets", value=self.targets, allowed="a list of positions, or "
                                 "use_block_cache=False")
            if "block_length" in st.extra:
                return rows, lambda: self._block_rerun(tokens, st.extra)
        if st is not None and ("query_end" in st.extra or (st.query_rows is not None and "forward_call" in st.extra)):
            # a KV-cached window (llada / dream kv_cache="prefix"/"dual", nemotron) or a block window (bd3lm): the
            # pre-pass is this very forward re-run unablated (same window, same cache), so its anchors are its own
            return rows, st.extra["forward_call"]
        kw = {} if st is not None else self.forward_kwargs
        return rows, lambda: self.model(tokens, attention_mask=am, return_type=None, **kw)

    def _block_rerun(self, tokens: Tensor, extra: dict) -> None:
        """The pre-pass of a block sampler's forward: the canvas up to its end under the run's block mask, without
        SDAR's KV cache (detached meanwhile, so the pre-pass neither reads nor extends it). Under the block-causal
        mask its rows and keys equal those of the cached forward, which covers a suffix of them."""
        saved = [getattr(b.attn, "kv", None) for b in self.model.blocks]
        for b in self.model.blocks:
            b.attn.kv = None
        try:
            self.model(tokens[:, :int(extra["query_end"])], block_length=extra["block_length"], return_type=None)
        finally:
            for b, kv in zip(self.model.blocks, saved):
                b.attn.kv = kv

    def _embed_hook(self, x: Tensor, hook: Any) -> None:
        if self._prepass:
            return
        self._rows, rerun = self._rows_and_rerun()
        if self.needs_prepass:
            self._prepass, self._anchors = True, {}
            try:
                rerun()
            finally:
                self._prepass = False

    def _target_mask(self, layer: int, scores: Tensor) -> Tensor:
        kv = C.visible_keys(scores)
        if not self.needs_prepass:
            m = torch.zeros_like(kv)
            # key column c is canvas position state.key_positions[c] (a bd3lm window past its context, or a KV
            # cache that skipped an unstored block); c itself on forwards whose keys are the canvas prefix
            st = self.model.state
            if st is not None and st.key_cols is not None and not is_block_diffusion(self.model):
                where = st.key_positions[0].tolist()[:m.shape[1]]
            else:
                where = range(m.shape[1])
            targets = set(self.targets)
            m[:, [c for c, p in enumerate(where) if p in targets]] = True
            return m & kv
        # under the block-causal mask a block run's forward holds the first keys of the pre-pass over the whole
        # canvas, with the same values (later blocks never reach earlier ones): the anchors are cut to its keys
        anchors = self._anchors[layer][..., :kv.shape[-1]]
        if self.targets == "anchors":
            return anchors
        self._wanted = anchors  # the random control's count to match (n_wanted vs n_knocked)
        return C.random_like(anchors, kv, self.gen)

    def _score_hook(self, layer: int):
        def hook(scores: Tensor, hook: Any) -> Tensor | None:
            if self._prepass:
                self._anchors[layer] = C.anchor_mask_from_scores(scores, self.rule, is_causal(self.model),
                                                                 **self.detect_kwargs)[0]
                return None
            t = self._target_mask(layer, scores)
            self.n_knocked[layer] = float(t.sum(-1).float().mean())
            if self._wanted is not None and int(self._wanted.sum()) > int(t.sum()):
                self.unmatched += 1  # fewer other visible keys than targets: a smaller cut than the one it controls
            if self.model.state is not None:
                self.knocked_by_step.setdefault(self.model.state.step, []).append(self.n_knocked[layer])
            rows = self._rows
            if rows.shape[-1] != scores.shape[-2]:  # a block run's forward: the query rows it computes
                state = self.model.state
                # a replay computes rows [0, query_end) (replay_rows), the sampler's forward [query_start, query_end)
                span = (state.extra.get("replay_rows", (state.extra.get("query_start", state.rows.start),))
                        if state is not None else (0,))
                q0 = int(span[0])
                rows = rows[:, q0:q0 + scores.shape[-2]]
            cut = rows[:, None, :, None] & t[:, None, None, :]
            new = scores.masked_fill(cut, -torch.inf)
            # the documented fallback: a row whose every visible key is a target keeps its scores (a softmax over
            # no key is undefined, NaN in every later layer); counted, so the probe can say where it happened
            dead = ~(new > torch.finfo(new.dtype).min).any(-1, keepdim=True)
            self.rows_kept[layer] = self.rows_kept.get(layer, 0) + int((dead[..., 0] & cut.any(-1)).sum())
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


class _RandomListHooks(KnockoutHooks):
    """Random control of a fixed target list: as many random visible positions outside the list."""

    def _target_mask(self, layer: int, scores: Tensor) -> Tensor:
        fixed = self._wanted = super()._target_mask(layer, scores)
        return C.random_like(fixed, C.visible_keys(scores), self.gen)


def _hooks_for(model: Any, spec: Any, layers: list[int], queries: str, rule: str, P: int, seed: int) -> KnockoutHooks:
    if isinstance(spec, tuple):   # random control of a fixed list: same count of other visible positions
        return _RandomListHooks(model, layers, spec[1], queries, rule, P, seed)
    return KnockoutHooks(model, layers, spec, queries, rule, P, seed)


def readout_hook(model: Any) -> str:
    """The hook whose activation alone gives the raw logits (`model.readout_hook`; default the final norm's
    normalized output, whose weight and the unembedding follow). HookedDDiT: `hook_final_modulated` (after the
    σ-dependent final adaLN, so the scorer reads the step's own conditioning)."""
    return getattr(model, "readout_hook", "ln_final.hook_normalized")


def readout(model: Any, act: Tensor) -> Tensor:
    """Raw logits from the activation at `readout_hook(model)`, exactly the forward's."""
    if hasattr(model, "readout_hook"):
        return model.unembed(act)
    return model.unembed(model.ln_final.apply_weight(act))


class _GoldScorer:
    """A hook on ``ln_final.hook_normalized`` that scores the gold answer at every sampler step:
    logits = unembed(w ⊙ normalized), exactly the forward's raw logits."""

    def __init__(self, model: Any, gold: Tensor):
        self.model, self.gold, self.lp, self.rank = model, gold, {}, {}

    def __call__(self, act: Tensor, hook: Any) -> None:
        st = self.model.state
        if st is None or st.phase != "cond":
            return
        raw = C.check_logits(readout(self.model, act), f"denoising step {st.step}")
        # a forward that computes only some rows (SDAR / Fast-dLLM v2 blocks) has them at canvas positions
        # st.rows (reading them as rows 0.. scored nothing, so every value was NaN)
        q0 = st.rows.start if raw.shape[1] < self.gold.shape[1] else 0
        lp, rank = (torch.full(self.gold.shape, torch.nan, dtype=torch.float64) for _ in range(2))
        got = C.gold_scores(self.model, raw, self.gold[:, q0:].to(raw.device))
        lp[:, q0:], rank[:, q0:] = (t.cpu() for t in got)
        self.lp[st.step], self.rank[st.step] = lp, rank

    def at_commit(self, commit_step: Tensor) -> tuple[Tensor, Tensor]:
        """(log-prob, rank) ``[batch, pos]`` read at the step that committed each position (NaN if none). A step
        that ran no forward (MDLM's ``ddpm_cache`` reusing its p(x0)) committed from the latest forward before it,
        so it is read there."""
        lp = torch.full(self.gold.shape, torch.nan, dtype=torch.float64)
        rank = lp.clone()
        cs = commit_step.cpu()
        scored = sorted(self.lp)
        for s in sorted(set(cs[cs >= 0].tolist())):
            source = s if s in self.lp else max((f for f in scored if f <= s), default=None)
            if source is not None:
                at = cs == s
                lp[at], rank[at] = self.lp[source][at], self.rank[source][at]
        return lp, rank


def _replay_scores(model: Any, out: Any, gold: Tensor) -> tuple[Tensor, Tensor]:
    """The clean run's scores at each commit step, by replaying its canvases (no hooks: same logits)."""
    scorer = _GoldScorer(model, gold)
    for s in range(out.n_steps):
        x, am = step_canvas(out, s)
        raw = C.check_logits(model(x, attention_mask=am, **step_forward_kwargs(out, s)), f"the clean run at step {s}")
        scorer.lp[s], scorer.rank[s] = (t.cpu() for t in C.gold_scores(model, raw, gold))
    return scorer.at_commit(out.trajectory.commit_step)


def _answer_totals(lp: Tensor, rank: Tensor, have: Tensor) -> tuple[float, float]:
    """Row sums of log-probs and row means of ranks over ``have``, then the mean over rows (NaN-aware)."""
    n = have.sum(-1)
    lp_row = torch.where(have, lp, torch.zeros_like(lp)).sum(-1)
    rank_row = torch.where(have, rank, torch.zeros_like(rank)).sum(-1) / n.clamp(min=1)
    ok = n > 0
    if not bool(ok.any()):
        return math.nan, math.nan
    return float(lp_row[ok].mean()), float(rank_row[ok].mean())


def _exact_match(model: Any, out: Any, gold: list[list[int]], answer: Any, offset: int, decode: Any) -> float:
    pred = C.clean_answer(model, out.generated.cpu(), offset)
    if isinstance(answer, str):
        from mdm_lens.items import normalize

        dec = decode or (lambda ids: _decode(model, ids))
        return float(np.mean([normalize(dec(p)) == normalize(answer) for p in pred]))
    return float(np.mean([p == g for p, g in zip(pred, gold)]))
