"""Attention knockout at denoising steps (Geva et al. 2023 edge blocking; Rulli et al. sink masking; spec §2.8).

    res = knockout(model, prompt_ids, answer="paris", steps=[0, 1, 2])
    res.table()            # one row per condition: clean / anchors / random
    res.effect             # answer log-prob under the knockout minus the clean one (the default metric)

The question a knockout answers is "does cutting these attention edges change the *answer*?".  So the
default metric is answer-level, measured at the end of generation, not at the positions a step commits
(a step that commits only ``<eos>`` slots says nothing about the answer, even though its forward pass also
predicts the answer's still-masked slots).  Per condition (clean, the knockout, a random control):

- ``answer_logprob`` (*sampled*, default ``metric``): the knockout is applied while sampling; for each gold
  answer position p, log softmax(logits)[gold_p] of the forward pass at the step that committed p in
  *that* run, summed over the answer's tokens (the log-probability the sampler gave the gold answer
  along its own path), mean over batch rows.
- ``answer_rank`` (sampled): at the same forwards, the number of tokens (the mask token excepted) whose
  logit is strictly above the gold token's, mean over the answer's tokens and rows (0 = argmax).
- ``exact_match`` (sampled): fraction of rows whose generated answer (from ``answer_offset`` to the first
  EOS/EoT/pad) equals the gold: token ids for id answers and the clean-run answer, SQuAD-normalised text
  for a text ``answer``.
- ``tf_answer_logprob`` / ``tf_answer_rank`` ``[condition, step]`` (*teacher-forced*): one forward per
  step s on the clean run's canvas x_s with the gold answer placed in it (answer positions already
  committed at s carry the gold tokens, the others stay masked), knockout on; log-prob summed / rank
  averaged over the gold positions that step predicts (MDM: still masked in x_s; ARM: the one emitted
  at s).  NaN at a step that predicts no answer position.  ``_mean`` fields average over the steps.
- ``step_metric`` ``[condition, step]`` / ``metric_mean`` (the earlier metric, by ``step_metric=``):
  teacher-forced on the clean trajectory, the metric at the positions the clean run committed at s.
- ``agreement``: fraction of generated tokens equal to the clean generation; ``accuracy``: substring match
  of the generation with ``answer`` (NaN without one).

On DiffusionGemma (:mod:`knockout_bd`) and on the ``nemotron`` / ``bd3lm`` samplers (:mod:`knockout_windowed`: step k
is the k-th denoising forward of the run, not its causal prefill / commit or storing forwards) only the sampled
metrics exist; the teacher-forced ones and ``step_metric`` are NaN with a note.

Without ``answer`` the gold is the clean run's own answer, so the metrics say how far the knockout moves
the model from what it said.  With classifier-free guidance the log-probs read the conditional forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from mdm_lens.probes._checks import own_generate_keywords
from mdm_lens.diffusion.fixed_length import refuse_variable_sampler
from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError, SamplerConfigError
from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.hooks import at_steps

from . import _causal as C
from ._ignored import refuse_ignored
from ._knockout_notes import metric_notes
from ._results import ResultMixin
from .retrieval import _decode, answer_correct
from ._runtools import is_block_diffusion
from mdm_lens.noisy import notes_for

from ._runtools import noisy_canvas
from .run import is_causal, step_canvas, step_forward_kwargs

from mdm_lens.diffusion.own_forwards import OWN_FORWARDS

from .knockout_bd import knockout_block_diffusion
from .knockout_windowed import grid_size, knockout_windowed
from ._knockout_hooks import (KnockoutHooks, _answer_totals, _exact_match, _GoldScorer, _hooks_for,  # noqa: F401
                              readout_hook,
                              _RandomListHooks, _replay_scores)

__all__ = ["knockout", "KnockoutResult", "KnockoutHooks", "ANSWER_METRICS"]

ANSWER_METRICS = ("answer_logprob", "answer_rank", "exact_match", "tf_answer_logprob", "tf_answer_rank")


@dataclass
class KnockoutResult(ResultMixin):
    """Answer-level and per-step metrics per condition (clean / knockout / random control); see the
    module docstring for what each number means.  ``value`` is the chosen ``metric`` per condition and
    ``effect`` = value − value[clean] (negative log-prob effect = the knockout lowers the answer)."""

    conditions: list[str]
    steps: list[int]
    layers: list[int]
    metric: str
    value: Tensor                   # [condition]  the chosen metric
    effect: Tensor                  # [condition]  value − value of "clean"
    answer_logprob: Tensor          # [condition]  sampled: Σ_answer log p(gold) at each position's commit step
    answer_rank: Tensor             # [condition]  sampled: mean rank of the gold tokens there, mask id left out
    exact_match: Tensor             # [condition]  generated answer == gold
    tf_answer_logprob: Tensor       # [condition, step]  teacher-forced, gold placed in the canvas
    tf_answer_rank: Tensor          # [condition, step]
    tf_answer_logprob_mean: Tensor  # [condition]  mean over the steps that predict an answer position
    tf_answer_rank_mean: Tensor     # [condition]
    step_metric_name: str
    step_metric: Tensor             # [condition, step]  at the positions the clean run committed at s
    metric_mean: Tensor             # [condition]
    n_targets: Tensor               # [condition, step]  mean knocked keys per (row, layer)
    agreement: Tensor               # [condition]  fraction of generated tokens equal to the clean generation
    accuracy: Tensor                # [condition]  substring match with ``answer`` (NaN without one)
    gold: list[list[int]] = field(default_factory=list)   # gold answer ids per batch row
    gold_source: str = "answer"     # "answer" or "clean generation"
    notes: list[str] = field(default_factory=list)
    condition_notes: list[str] = field(default_factory=list)  # per condition: NaN reason, unmatched control, …
    # sampled-only routes (DiffusionGemma, nemotron, bd3lm): forwards each condition's knockout cut; None elsewhere
    forwards_cut: Tensor | None = None

    _dims: ClassVar = {"value": ("condition",), "effect": ("condition",), "answer_logprob": ("condition",),
                       "answer_rank": ("condition",), "exact_match": ("condition",),
                       "tf_answer_logprob": ("condition", "step"), "tf_answer_rank": ("condition", "step"),
                       "tf_answer_logprob_mean": ("condition",), "tf_answer_rank_mean": ("condition",),
                       "step_metric": ("condition", "step"), "metric_mean": ("condition",),
                       "n_targets": ("condition", "step"), "agreement": ("condition",), "accuracy": ("condition",)}

    def _coords(self):
        return {"condition": self.conditions, "step": self.steps}

    def to_frame(self, lead_dims: Sequence[str] | None = None, metrics: Sequence[str] | None = None):
        """Long format (`ResultMixin.to_frame`) with a `note` column: why a row's value is NaN or not comparable —
        the condition's note (an unmatched random control, a cut that cut nothing), a metric the sampler cannot
        give, a step the run never reached, a step at which the metric is undefined; "" where the value stands."""
        df = super().to_frame(lead_dims, metrics)
        by_condition = dict(zip(self.conditions, self.condition_notes))
        df["note"] = df["condition"].map(by_condition).fillna("") if "condition" in df else ""
        metric_notes(df, self.notes)
        return df

    def table(self):
        """Wide summary, one row per condition: value, effect, the answer-level metrics (sampled, then
        teacher-forced means), ``metric_mean`` (the per-step committed-position metric), agreement, accuracy."""
        cols = ["value", "effect", "answer_logprob", "answer_rank", "exact_match", "tf_answer_logprob_mean",
                "tf_answer_rank_mean", "metric_mean", "agreement", "accuracy"]
        wide = self.to_frame(metrics=cols).pivot(index="condition", columns="metric", values="value")
        wide = wide.loc[self.conditions, cols]
        wide["note"] = self.condition_notes or [""] * len(self.conditions)  # why a value is NaN or not comparable
        return wide


# ----------------------------------------------------------------------------------------------
# pieces of one knockout run
# ----------------------------------------------------------------------------------------------

def _conditions(targets: Any, n_random: int) -> list[tuple[str, Any]]:
    main = [(targets if isinstance(targets, str) else "targets", targets)]
    if targets != "random" and n_random > 0:
        main.append(("random", "random" if targets == "anchors" else ("random_list", list(targets))))
    return main



def _teacher_canvas(model: Any, clean: Any, s: int, gold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(canvas with the gold answer placed, attention mask, gold positions predicted at s)."""
    x, am = step_canvas(clean, s)
    g = gold[:, : x.shape[1]].to(x.device)
    if g.shape[1] < x.shape[1]:  # a block run's canvas tail past the output: no gold there
        g = torch.cat([g, g.new_full((g.shape[0], x.shape[1] - g.shape[1]), -1)], 1)
    if is_causal(model):
        x = torch.where(g >= 0, g, x)
        predicted = torch.zeros_like(gold, dtype=torch.bool)
        predicted[:, x.shape[1]] = gold[:, x.shape[1]] >= 0
        return x, am, predicted
    masked = noisy_canvas(model, x, clean.prompt_length)
    x = torch.where((g >= 0) & ~masked, g, x)
    predicted = torch.zeros_like(gold, dtype=torch.bool)
    w = min(x.shape[1], gold.shape[1])
    predicted[:, :w] = (masked & (g >= 0))[:, :w]
    return x, am, predicted


@torch.no_grad()
def _step_forward(model: Any, x: Tensor, am: Tensor, ko: KnockoutHooks | None, kw: dict) -> tuple[Tensor, float]:
    """One step's forward as the run's sampler ran it (``kw``: `step_forward_kwargs`), knocked out by ``ko``."""
    if ko is None:
        return C.check_logits(model(x, attention_mask=am, **kw), "the clean teacher-forced forward"), 0.0
    ko.tokens, ko.attention_mask, ko.forward_kwargs, ko.n_knocked = x, am, kw, {}
    raw = C.check_logits(model.run_with_hooks(x, attention_mask=am, fwd_hooks=ko.hooks(), **kw),
                         "the knocked-out teacher-forced forward")
    return raw, float(np.mean(list(ko.n_knocked.values()))) if ko.n_knocked else 0.0


def _committed_metric(model: Any, clean: Any, s: int, raw: Tensor, metric: Any) -> float:
    """The per-step metric at the positions the clean run committed at step s (readout rows of ``raw``)."""
    committed = clean.trajectory.commit_step.to(raw.device) == s
    target = clean.tokens[committed]
    logits = C.readout(model, raw, committed)
    return C.metric_value(metric, logits, target, C.best_other(logits, target, model.cfg.mask_token_id))



def _resolve_steps(steps: Any, n_steps: int, what: str = "step") -> list[int] | None:
    """None (every step) or sorted step indices; "first"/"last" and negatives as in ``at_steps``."""
    if steps is None:
        return None
    if isinstance(steps, (str, int)):
        steps = [steps]
    if isinstance(steps, (list, tuple)):
        if not steps:  # before the range check: its bound may be a placeholder (1e9 while the grid is unknown)
            raise ArgumentError("steps=[] selects no step; leave steps=None for every step of the run.",
                                argument="steps", value=steps, allowed="None or at least one step")
        steps = [0 if v == "first" else -1 if v == "last" else v for v in steps]
    return sorted(validate.indices(steps, n_steps, name="steps", what=what))


def _value(metric: Any, row: dict) -> float:
    return row["metric_mean"] if not isinstance(metric, str) or metric not in ANSWER_METRICS else {
        "answer_logprob": row["answer_logprob"], "answer_rank": row["answer_rank"],
        "exact_match": row["exact_match"], "tf_answer_logprob": row["tf_answer_logprob_mean"],
        "tf_answer_rank": row["tf_answer_rank_mean"]}[metric]


@torch.no_grad()
def knockout(model: Any, prompt_ids: Any, *, steps: Any = None, layers: Any = None, targets: Any = "anchors",
             queries: Literal["masked", "all", "answer"] = "masked", rule: str = "zscore", n_random: int = 3,
             seed: int = 0, metric: Any = "answer_logprob", step_metric: C.Metric = "logit_diff", answer: Any = None,
             answer_offset: int = 0, gen_length: int | None = None, n_steps: int | None = None, decode: Any = None,
             **generate_kwargs: Any) -> KnockoutResult:
    """Attention knockout of anchors (or chosen keys) at chosen denoising steps and layers.

    At each step in ``steps`` (None = all; negatives and "first"/"last" allowed) and layer in ``layers``
    (None = all), the pre-softmax scores ``A_pre[i, j] := −inf`` for queries i in ``queries`` and keys j
    in ``targets`` (see :class:`KnockoutHooks`).  Conditions: ``clean``; the targets; ``random``
    (``n_random`` draws of as many other visible keys, averaged).  What each reported number means is
    in the module docstring; ``metric`` picks the headline ``value`` / ``effect``:

    - ``"answer_logprob"`` (default), ``"answer_rank"``, ``"exact_match"``: sampled with the knockout on,
      read at the end (does the answer change?);
    - ``"tf_answer_logprob"``, ``"tf_answer_rank"``: teacher-forced with the gold answer in the canvas;
    - ``"logit_diff"``, ``"prob"``, ``"logprob"`` or a callable ``metric(logits)``: the earlier per-step
      metric at the positions the clean run committed at each step (``step_metric``, ``metric_mean``).

    ``answer``: text or token ids of the gold answer, placed at canvas offset ``answer_offset``; without
    it the gold is the clean run's own answer.  ``generate_kwargs`` go to every ``model.generate`` call
    (same seed in every condition).  Raises ``OutOfRangeError`` for steps / layers / target positions
    outside the run, ``ArgumentError`` / ``ArgumentTypeError`` for other invalid arguments, and
    ``NonFiniteError`` when the model's logits are NaN or inf.
    """
    own_generate_keywords(generate_kwargs, knockout)
    refuse_variable_sampler(generate_kwargs, 'knockout',
                            'a knocked-out key column would be a different token at another step, and the answer positions scored at the end would not be the ones knocked out')
    from mdm_lens.probes._retrieval_items import check_decode

    check_decode(decode)
    dev = model.input_device
    prompt = C.prompt_batch(prompt_ids, "prompt_ids", dev)
    g = validate.integer(gen_length if gen_length is not None else model.cfg.extra.get("gen_length", 4),
                         name="gen_length", min=1)
    # no n_steps given: gen_length is knockout's own default (DerivedSteps), which threshold / factor rules accept
    ns = g if is_causal(model) else derived_steps(
        None if n_steps is None else validate.integer(n_steps, name="n_steps", min=1), g)
    ls = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    P = prompt.shape[1]
    sampler = None if is_block_diffusion(model) else _check_sampler(model, generate_kwargs)
    # nemotron / bd3lm: the grid is the run's denoising forwards (own_forwards), not the sampler's steps setting
    if sampler is None or sampler in OWN_FORWARDS:
        grid = grid_size(model, sampler, P, g, ns) if sampler in OWN_FORWARDS else ns
        chosen = _resolve_steps(steps, grid)
        step_list = chosen if chosen is not None else list(range(grid))
    else:  # the types now; the range once the clean run says how many forwards it made (below)
        _resolve_steps(steps, 10 ** 9)
    if isinstance(targets, str):
        validate.choice(targets, ("anchors", "random"), name="targets")
    else:
        # [] cuts nothing: a no-op control whose values equal clean exactly (the scoring path is the same)
        targets = validate.indices(targets, P + g, name="targets", what="position", allow_empty=True)
        refuse_ignored("rule", rule, "zscore", by="targets", by_value=targets, why="rule picks the anchors (and the "
                       "random control's count) only when targets='anchors' or 'random'")
    validate.choice(queries, C.QUERIES, name="queries")
    n_random = validate.integer(n_random, name="n_random", min=0)
    seed = validate.seed(seed, min=None)
    off = validate.integer(answer_offset, name="answer_offset", min=0, max=g - 1)
    if callable(metric) or metric in C.POSITION_METRICS:
        step_metric = metric
    else:
        validate.choice(metric, ANSWER_METRICS + C.POSITION_METRICS, name="metric")
    step_metric = C.check_position_metric(step_metric, "step_metric")
    if sampler is None or sampler in OWN_FORWARDS:  # DiffusionGemma, nemotron, bd3lm: the sampled metrics only
        route = (knockout_block_diffusion if sampler is None else
                 lambda *a, **kw: knockout_windowed(*a, sampler=sampler, **kw))
        return _sampled_only(route, model, prompt, step_list, chosen, ls, targets, queries, rule, n_random, seed,
                             metric, answer, off, g, ns, decode, generate_kwargs)

    def gen(hooks: Sequence[Any] = ()) -> Any:
        return model.generate(prompt, steps=ns, gen_length=g, fwd_hooks=list(hooks), **generate_kwargs)

    clean = gen()
    # the grid is the clean run's forwards: an adaptive sampler (LLaDA2 / SDAR blocks, threshold commits, a stop
    # token) makes more or fewer than n_steps, and "last" / -1 is its last forward, not step n_steps − 1
    chosen = _resolve_steps(steps, clean.n_steps, what=f"forward of the clean run ({clean.n_steps} made)")
    step_list = chosen if chosen is not None else list(range(clean.n_steps))
    if answer is None:
        gold_ids, source = C.clean_answer(model, clean.generated.cpu(), off), "clean generation"
    else:
        gold_ids, source = C.gold_answer(model, answer, prompt.shape[0], g, off), "answer"
    gold = C.gold_grid(gold_ids, P, clean.tokens.shape[1], off, dev)
    have = (gold >= 0).cpu()
    clean_scores = _clean_scores(gen, clean, model, gold)

    def one_draw(spec: Any, d: int) -> dict:
        ko = None if spec is None else _hooks_for(model, spec, ls, queries, rule, P, seed + d)
        rows: dict[str, list] = {"tf_lp": [], "tf_rank": [], "sm": [], "nt": []}
        for s in step_list:
            x, am = step_canvas(clean, s)
            raw, n = _step_forward(model, x, am, ko, step_forward_kwargs(clean, s))
            rows["sm"].append(_committed_metric(model, clean, s, raw, step_metric))
            rows["nt"].append(n)
            xt, amt, predicted = _teacher_canvas(model, clean, s, gold)
            raw_t = raw if torch.equal(xt, x) else _step_forward(model, xt, amt, ko, step_forward_kwargs(clean, s))[0]
            lp, rk = C.gold_scores(model, raw_t, gold)
            a, r = _answer_totals(lp.cpu(), rk.cpu(), predicted.cpu())
            rows["tf_lp"].append(a)
            rows["tf_rank"].append(r)
        if ko is None:
            out, (lp, rk) = clean, clean_scores
        else:
            scorer = _GoldScorer(model, gold)
            out = gen(ko.step_hooks(chosen) + [(readout_hook(model), scorer)])
            lp, rk = scorer.at_commit(out.trajectory.commit_step)
        a_lp, a_rank = _answer_totals(lp, rk, have)
        acc = (float(np.mean([answer_correct(model, r.cpu(), answer, decode) for r in out.generated]))
               if answer is not None else math.nan)
        return dict(tf_lp=rows["tf_lp"], tf_rank=rows["tf_rank"], sm=rows["sm"], nt=rows["nt"],
                    unmatched=0 if ko is None else ko.unmatched, kept=0 if ko is None else sum(ko.rows_kept.values()),
                    answer_logprob=a_lp, answer_rank=a_rank, exact_match=_exact_match(model, out, gold_ids, answer,
                                                                                       off, decode),
                    agreement=float((out.generated == clean.generated).float().mean()), accuracy=acc)

    names, per = [], []
    for name, spec in [("clean", None)] + _conditions(targets, n_random):
        draws = [one_draw(spec, d) for d in range(n_random if name == "random" else 1)]
        names.append(name)
        per.append({k: np.mean([dr[k] for dr in draws], 0) for k in draws[0]})
    t = lambda k: torch.tensor(np.array([p[k] for p in per], dtype=np.float64))  # noqa: E731
    tf_lp, tf_rank, sm = t("tf_lp"), t("tf_rank"), t("sm")
    summary = [dict(p, metric_mean=float(torch.tensor(p["sm"]).nanmean()),
                    tf_answer_logprob_mean=float(torch.tensor(p["tf_lp"]).nanmean()),
                    tf_answer_rank_mean=float(torch.tensor(p["tf_rank"]).nanmean())) for p in per]
    value = torch.tensor([_value(metric, row) for row in summary], dtype=torch.float64)
    notes = notes_for(model.cfg) + ([] if bool(torch.isfinite(tf_lp).any()) else [
        "no chosen step predicts a gold answer position (all committed before): teacher-forced answer metrics are NaN"])
    return KnockoutResult(
        conditions=names, steps=step_list, layers=ls, metric=C.metric_name(metric), value=value, effect=value - value[0],
        answer_logprob=t("answer_logprob"), answer_rank=t("answer_rank"), exact_match=t("exact_match"),
        tf_answer_logprob=tf_lp, tf_answer_rank=tf_rank, tf_answer_logprob_mean=tf_lp.nanmean(-1),
        tf_answer_rank_mean=tf_rank.nanmean(-1), step_metric_name=C.metric_name(step_metric), step_metric=sm,
        metric_mean=sm.nanmean(-1), n_targets=t("nt"), agreement=t("agreement"), accuracy=t("accuracy"),
        gold=gold_ids, gold_source=source, notes=notes, condition_notes=_condition_notes(names, per, value))


def _check_sampler(model: Any, generate_kwargs: dict) -> str:
    """Knockout drives the sampler by `steps=` and `gen_length=` and cuts step k's forward: a sampler without a
    `steps` setting (fastdllm_v2 commits by threshold, nemotron_ar is autoregressive) is refused before any run,
    naming the sampler, not with the sampler's own complaint about a `steps=` the user never passed."""
    import dataclasses

    from mdm_lens.diffusion import registry
    from mdm_lens.diffusion.generate import default_sampler

    name = generate_kwargs.get("sampler", "auto")
    plugin = registry.get(default_sampler(model) if name == "auto" else name)
    fields = {f.name for f in dataclasses.fields(plugin.Settings)} if dataclasses.is_dataclass(
        getattr(plugin, "Settings", None)) else set()
    if not {"steps", "gen_length"} <= fields:
        raise SamplerConfigError(
            f"knockout runs the sampler with steps= and gen_length= and cuts the forward of each step; sampler="
            f"{plugin.name!r} has no fixed number of steps (its settings: {sorted(fields)}), so its forwards cannot be "
            "chosen by step. Use a sampler with a steps setting (llada, dream, llada2, sdar, ...), or cut its forwards "
            "yourself with KnockoutHooks in model.generate(fwd_hooks=...).", argument="sampler", value=plugin.name,
            allowed="a sampler with steps and gen_length settings")
    return plugin.name


def _clean_scores(gen: Any, clean: Any, model: Any, gold: Tensor) -> tuple[Tensor, Tensor]:
    """The clean run's gold scores from a second clean run with the scorer on (same seed, same path): the forwards
    the knocked runs are scored on, so a knockout that cuts nothing equals clean exactly, block samplers' cached
    forwards included. A run that does not repeat (seed=None) falls back to replaying its canvases."""
    scorer = _GoldScorer(model, gold)
    again = gen([(readout_hook(model), scorer)])
    if torch.equal(again.tokens, clean.tokens) and torch.equal(again.trajectory.commit_step, clean.trajectory.commit_step):
        return scorer.at_commit(clean.trajectory.commit_step)
    return _replay_scores(model, clean, gold)


def _condition_notes(names: list[str], per: list[dict], value: Tensor) -> list[str]:
    """Per condition: why its value is NaN, whether its random control was smaller than the cut it controls, and
    how many query rows kept their scores because every visible key was a target."""
    notes = []
    for name, p, v in zip(names, per, value.tolist()):
        why = []
        if math.isnan(v):
            why.append("NaN: a gold answer position was not scored (never committed, or committed at no scored "
                       "forward), or there is no gold")
        if p.get("unmatched", 0) > 0:
            why.append(f"unmatched control: at {p['unmatched']:g} (forward, layer) cuts fewer other keys were visible "
                       "than there are targets, so it cut fewer keys (compare n_targets)")
        nt = torch.as_tensor(p.get("nt", []), dtype=torch.float64).nan_to_num(0.0)
        if name != "clean" and nt.numel() and not bool((nt > 0).any()):
            cause = ("no listed position was a visible key of a scored forward (targets=[] is the no-op control)"
                     if name == "targets" else "e.g. no anchor passed the rule")
            why.append(f"nothing cut: the {name} condition found no target key at any scored step ({cause}), so it "
                       "is the clean run")
        if p.get("kept", 0) > 0:
            why.append(f"{p['kept']:g} query rows kept their scores: every visible key was a target (softmax "
                       "over no key is undefined)")
        notes.append("; ".join(why))
    return notes


def _sampled_only(route: Any, model: Any, prompt: Tensor, step_list: list[int], chosen: list[int] | None,
                  ls: list[int], targets: Any, queries: str, rule: str, n_random: int, seed: int, metric: Any,
                  answer: Any, off: int, g: int, ns: int, decode: Any, generate_kwargs: dict) -> KnockoutResult:
    """:func:`knockout` on DiffusionGemma (:mod:`knockout_bd`) and on nemotron / bd3lm (:mod:`knockout_windowed`):
    the sampled metrics; the teacher-forced ones and the per-step committed metric NaN (noted)."""
    r = route(model, prompt, step_list=step_list, chosen=chosen, layers=ls, targets=targets,
                                 queries=queries, rule=rule, n_random=n_random, seed=seed, metric=metric,
                                 answer=answer, offset=off, g=g, ns=ns, decode=decode,
                                 conditions=_conditions(targets, n_random), generate_kwargs=generate_kwargs)
    t = lambda k: torch.tensor(np.array([p[k] for p in r["per"]], dtype=np.float64))  # noqa: E731
    nan_steps = torch.full((len(r["names"]), len(step_list)), math.nan, dtype=torch.float64)
    nan_cond = torch.full((len(r["names"]),), math.nan, dtype=torch.float64)
    value = t(metric)
    return KnockoutResult(
        conditions=r["names"], steps=step_list, layers=ls, metric=C.metric_name(metric), value=value,
        effect=value - value[0], answer_logprob=t("answer_logprob"), answer_rank=t("answer_rank"),
        exact_match=t("exact_match"), tf_answer_logprob=nan_steps, tf_answer_rank=nan_steps.clone(),
        tf_answer_logprob_mean=nan_cond, tf_answer_rank_mean=nan_cond.clone(), step_metric_name="not applicable",
        step_metric=nan_steps.clone(), metric_mean=nan_cond.clone(), n_targets=t("nt"), agreement=t("agreement"),
        accuracy=t("accuracy"), gold=r["gold_ids"], gold_source=r["source"], notes=r["notes"],
        condition_notes=_condition_notes(r["names"], r["per"], value), forwards_cut=t("forwards_cut"))
