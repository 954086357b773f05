"""Pieces shared by the causal tools (:mod:`knockout`, :mod:`patching`): anchors from pre-softmax scores,
random controls, readout rows, the per-position metrics, and the gold-answer scorer.

Readout row q(p) of canvas position p: p for unshifted MDMs (LLaDA), p − 1 for ``cfg.logit_shift`` MDMs
(Dream) and causal ARMs (see :func:`mdm_lens.probes.run.readout_shift`).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, NonFiniteError

from . import floating
from .run import is_causal, readout_shift

Metric = Literal["logit_diff", "prob", "logprob"] | Callable[[Tensor], Any]
POSITION_METRICS = ("logit_diff", "prob", "logprob")
QUERIES = ("masked", "all", "answer")


def no_nan(x: Tensor, name: str) -> Tensor:
    """Refuse NaN but allow ±inf (−inf is how masked keys are written in pre-softmax scores)."""
    n = int(torch.isnan(x).sum()) if x.is_floating_point() else 0
    if n:
        raise NonFiniteError(f"{name}={validate.describe(x)} is invalid: expected no NaN ({n} NaN of {x.numel()}).",
                             argument=name, value=x, allowed="no NaN")
    return x


def metric_name(metric: Any) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")


def check_position_metric(metric: Any, name: str = "metric") -> Any:
    """A built-in per-position metric name or a callable ``metric(logits) -> float``."""
    return metric if callable(metric) else validate.choice(metric, POSITION_METRICS, name=name)


def visible_keys(scores: Float[Tensor, "batch head query key"]) -> Bool[Tensor, "batch key"]:
    """Keys some query may attend: masked scores are −inf (ours) or the dtype's minimum (transformers' masks)."""
    return (scores > torch.finfo(scores.dtype).min).any(1).any(1)


def anchor_mask_from_scores(scores: Float[Tensor, "batch head query key"], rule: str = "zscore", causal: bool = False,
                            **detect_kwargs: Any) -> tuple[Bool[Tensor, "batch key"], Bool[Tensor, "batch key"]]:
    """(anchors [batch, key], key_visible [batch, key]) of one layer from its pre-softmax scores
    ``[batch, head, query, key]``: head-mean softmax pattern → mass received over the query rows that
    see any key → ``floating.detect_anchors(rule)``.  A key is visible when some query gives it a score
    above the dtype's minimum (−inf, or transformers' additive minimum, marks masked keys)."""
    validate.tensor(scores, name="scores", ndim=4, dtype="float")
    no_nan(scores, "scores")
    seen = scores > torch.finfo(scores.dtype).min  # -inf or the dtype's minimum (transformers' masks) = hidden
    kv, rows = visible_keys(scores), seen.any(1).any(-1)                   # [b, key], [b, query]
    pattern = torch.nan_to_num(torch.softmax(scores.float(), -1), nan=0.0).mean(1).to(torch.float64)
    rec = floating.received_attention(pattern, query_mask=rows, key_visible=kv, causal=causal)
    return floating.detect_anchors(rec, rule=rule, key_visible=kv, causal=causal, **detect_kwargs), kv


def random_like(anchors: Bool[Tensor, "batch key"], visible: Bool[Tensor, "batch key"],
                gen: torch.Generator) -> Bool[Tensor, "batch key"]:
    """Per row, as many random visible non-anchor keys as the row has anchors (fewer if there are not enough)."""
    out = torch.zeros_like(anchors)
    cand_all = visible & ~anchors
    for b in range(anchors.shape[0]):
        cand = cand_all[b].nonzero().flatten().cpu()
        n = min(int(anchors[b].sum()), len(cand))
        if n:
            out[b, cand[torch.randperm(len(cand), generator=gen)[:n]].to(out.device)] = True
    return out


def readout_rows(model: Any, tokens: Int[Tensor, "batch pos"], prompt_length: int, queries: str) -> Tensor:
    """Query rows of a forward: all, the readout rows q(p) of masked positions, or of canvas positions.
    For an ARM, "masked" is the emitting (last) row and "answer" every row ≥ prompt_length − 1."""
    validate.choice(queries, QUERIES, name="queries")
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
        from mdm_lens.noisy import noisy_positions

        pos = noisy_positions(model.cfg, tokens, prompt_length)
    else:
        pos[:, prompt_length:] = True
    if readout_shift(model):
        pos = torch.cat([pos[:, 1:], torch.zeros_like(pos[:, :1])], 1)
    return pos


def metric_value(metric: Metric, logits: Float[Tensor, "n vocab"], target: Tensor, counter: Tensor | None) -> float:
    """Scalar per-position metric on readout logits ``[n, vocab]``, averaged over the n positions:
    ``logit_diff`` = mean(logit_target − logit_counter), ``logprob`` = mean log softmax(logits)_target,
    ``prob`` = mean softmax(logits)_target; a callable gets the logits itself."""
    if callable(metric):
        value = metric(logits)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)) and not (
                isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point()):
            raise ArgumentTypeError(f"metric returned {validate.describe(value)}: a callable metric maps the readout "
                                    "logits [n, vocab] to one number (a float or a 0-d / one-element float tensor).",
                                    argument="metric", value=metric, allowed="a callable returning a scalar")
        return float(value)
    lf = logits.float()
    if metric == "logit_diff":
        return float((lf.gather(-1, target[:, None]) - lf.gather(-1, counter[:, None])).mean())
    lp = lf.log_softmax(-1).gather(-1, target[:, None])
    if metric == "logprob":
        return float(lp.mean())
    if metric == "prob":
        return float(lp.exp().mean())
    raise ArgumentError(f"metric={metric!r} is invalid: expected one of {POSITION_METRICS} or a callable.",
                        argument="metric", value=metric, allowed=str(POSITION_METRICS))


def best_other(logits: Float[Tensor, "n vocab"], exclude: Tensor, mask_id: int | None) -> Tensor:
    """The strongest token other than ``exclude`` (and never the mask token), per row."""
    lf = logits.float().clone()
    lf.scatter_(-1, exclude[:, None], -torch.inf)
    if mask_id is not None:
        lf[:, mask_id] = -torch.inf
    return lf.argmax(-1)


def readout(model: Any, raw: Float[Tensor, "batch pos vocab"], committed: Bool[Tensor, "batch pos"]) -> Tensor:
    """Raw logits ``[b, T, vocab]`` → the readout logits of the chosen positions ``[n, vocab]``."""
    b_idx, p_idx = committed.nonzero(as_tuple=True)
    return raw[b_idx, p_idx - readout_shift(model)]


def check_logits(logits: Tensor, where: str) -> Tensor:
    """NaN/inf in the model's logits would turn every metric into NaN: refuse them, naming the run."""
    return validate.finite(logits, name=f"logits of {where}")


# ----------------------------------------------------------------------------------------------
# the gold answer: ids, where it sits in the canvas, and its log-probability and rank
# ----------------------------------------------------------------------------------------------

def _stop_ids(model: Any) -> set[int]:
    cfg = model.cfg
    ids = {cfg.eos_token_id, cfg.pad_token_id, cfg.extra.get("eot_token_id"), cfg.extra.get("eos_token_id")}
    return {int(i) for i in ids if isinstance(i, int)}


def clean_answer(model: Any, generated: Int[Tensor, "batch gen"], offset: int) -> list[list[int]]:
    """The answer a run gave, per row: its generated tokens from ``offset`` up to the first EOS/EoT/pad.
    A row that starts with EOS answers "nothing": its answer is that one EOS token."""
    stop = _stop_ids(model)
    rows = []
    for r in generated.tolist():
        ans = []
        for t in r[offset:]:
            if t in stop:
                break
            ans.append(t)
        rows.append(ans or r[offset:offset + 1])
    return rows


def _encode_text(model: Any, text: str) -> list[int]:
    """Text → ids with the model's own tokenizer; without one, a typed error asking for ids."""
    from mdm_lens import tokenization

    from ._text import model_tokenizer

    tokenizer = model_tokenizer(model, "answer", text, "the answer as token ids")
    ids = tokenization.encode(tokenizer, text)
    unknown = tokenization.unknown_ids_in(tokenizer, ids)
    if unknown:  # scored as <unk>, the answer's log-prob would measure the unknown token, not the answer
        raise InputError(f"answer={text!r} tokenizes to the unknown token at position(s) {unknown} of {ids}: this "
                         "tokenizer cannot spell it, so its log-prob would be the <unk> token's. Pass an answer the "
                         "tokenizer spells, or its token ids.", argument="answer", value=text,
                         allowed="text without unknown tokens, or token ids")
    return ids


def prompt_batch(ids: Any, name: str, device: Any) -> Tensor:
    """Prompt ids ``[pos]`` or ``[batch, pos]`` as a long ``[batch, pos]`` tensor; float ids are refused
    (they would be truncated silently)."""
    if isinstance(ids, str) or (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str)):
        from mdm_lens.errors import InputTypeError

        raise InputTypeError(f"{name}={validate.describe(ids)} is text: this probe takes token ids; tokenize first "
                             "(model.to_tokens(text)).", argument=name, value=ids, allowed="token ids [pos] or [batch, pos]")
    t = validate.tensor(torch.as_tensor(ids), name=name, ndim=(1, 2), dtype="int")
    return (t[None] if t.ndim == 1 else t).long().to(device)


def gold_answer(model: Any, answer: Any, batch: int, gen_length: int, offset: int) -> list[list[int]]:
    """Gold ids per row from ``answer``: token ids (a list / 1-d tensor, the same for every row) or text
    (tokenised with the model's tokenizer, no BOS).  Must fit in the canvas after ``offset``."""
    if isinstance(answer, str):
        ids = _encode_text(model, answer)
    else:
        t = validate.tensor(torch.as_tensor(answer), name="answer", ndim=1, dtype="int")
        ids = t.tolist()
    if not ids:
        raise ArgumentError(f"answer={answer!r} is invalid: it has no tokens.", argument="answer", value=answer,
                            allowed="a non-empty text or id list")
    for i, t in enumerate(ids):
        validate.integer(t, name=f"answer[{i}]", min=0, max=model.cfg.d_vocab - 1)
    mask = model.cfg.mask_token_id
    if mask is not None and mask in ids:  # a gold mask token: its log-prob scores "still masked", not an answer
        raise InputError(f"answer={validate.describe(answer)} holds the mask id {mask} at position(s) "
                         f"{[i for i, t in enumerate(ids) if t == mask]}: a gold token must be one the sampler can "
                         "commit as an answer.", argument="answer", value=validate.describe(answer),
                         allowed=f"ids other than the mask id {mask}")
    if offset + len(ids) > gen_length:
        raise ArgumentError(f"answer of {len(ids)} tokens at answer_offset={offset} does not fit in gen_length="
                            f"{gen_length}.", argument="answer", value=answer,
                            allowed=f"at most {gen_length - offset} tokens")
    return [list(ids) for _ in range(batch)]


def gold_grid(gold: Sequence[Sequence[int]], prompt_length: int, total: int, offset: int,
              device: Any) -> Int[Tensor, "batch pos"]:
    """``[batch, total]`` with the gold id at each answer position and −1 elsewhere."""
    g = torch.full((len(gold), total), -1, dtype=torch.long, device=device)
    for b, ids in enumerate(gold):
        s = prompt_length + offset
        g[b, s:s + len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
    return g


def gold_scores(model: Any, raw: Float[Tensor, "batch pos vocab"], gold: Int[Tensor, "batch total"]
                ) -> tuple[Float[Tensor, "batch total"], Float[Tensor, "batch total"]]:
    """(log-prob, rank) of the gold token at every answer position p whose readout row q(p) exists in
    this forward; NaN elsewhere.  log-prob = log softmax(logits[q(p)])[gold_p] (temperature 1, full
    vocabulary); rank = number of tokens other than the mask token with a strictly larger logit
    (0 = the gold token is the argmax, ties count in its favour)."""
    b, T = raw.shape[:2]
    shift = readout_shift(model)
    lp = torch.full(gold.shape, torch.nan, dtype=torch.float64, device=raw.device)
    rank = lp.clone()
    rows = torch.arange(gold.shape[1], device=raw.device) - shift
    have = (gold >= 0) & (rows >= 0)[None] & (rows < T)[None]
    if not bool(have.any()):
        return lp, rank
    b_idx, p_idx = have.nonzero(as_tuple=True)
    logits = raw[b_idx, rows[p_idx]].double()                               # [n, vocab]
    target = gold[b_idx, p_idx]
    own = logits.gather(-1, target[:, None])
    lp[b_idx, p_idx] = (logits.log_softmax(-1).gather(-1, target[:, None]))[:, 0]
    above = logits > own
    if model.cfg.mask_token_id is not None:
        above[:, model.cfg.mask_token_id] = False
    rank[b_idx, p_idx] = above.sum(-1).double()
    return lp, rank
