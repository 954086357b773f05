"""Retrieval probe, shared part: the item type (``RetrievalItem`` and its conversion from a `QAItem`), the answer
check and the result type. Why a module of its own: both `retrieval` (the scores) and `ablation` (the causal
check) need them, and neither may import the other both ways."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import pandas as pd
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, InputTypeError, OutOfRangeError

from ._results import ResultMixin, to_numpy
from ._text import encode_with_offsets, model_tokenizer


# ----------------------------------------------------------------------------------------------
# items
# ----------------------------------------------------------------------------------------------

@dataclass
class RetrievalItem:
    """One prompt with its needle: ``evidence`` = token spans [start, end) of the answer-bearing span,
    ``answer`` = gold text (substring match) or gold token ids (must appear contiguously in the
    generation), ``gold_doc`` = token span of the gold document (for ``evidence_focus``)."""

    prompt_ids: Tensor
    evidence: list[tuple[int, int]]
    answer: str | Sequence[int] | Tensor
    gold_doc: tuple[int, int] | None = None

    def __post_init__(self):
        ids = self.prompt_ids
        if isinstance(ids, (list, tuple)):
            ids = self.prompt_ids = torch.tensor(ids, dtype=torch.long)
        validate.tensor(ids, name="prompt_ids", ndim=1, dtype="int")
        n = ids.shape[0]
        if isinstance(self.evidence, tuple) and len(self.evidence) == 2 and all(isinstance(x, int) for x in self.evidence):
            raise ArgumentTypeError(f"evidence={self.evidence!r} is invalid: expected a list of (start, end) spans; "
                                    f"write evidence=[{self.evidence!r}].", argument="evidence", value=self.evidence,
                                    allowed="[(start, end), ...]")
        if isinstance(self.evidence, (str, bytes)) or not isinstance(self.evidence, Sequence):
            raise ArgumentTypeError(f"evidence={self.evidence!r} is invalid: expected a list of (start, end) spans.",
                                    argument="evidence", value=self.evidence, allowed="[(start, end), ...]")
        self.evidence = [_span(e, n, f"evidence[{i}]") for i, e in enumerate(self.evidence)]
        if self.gold_doc is not None:
            self.gold_doc = _span(self.gold_doc, n, "gold_doc")
        ans = self.answer
        if isinstance(ans, str):
            if not ans.strip():
                raise ArgumentError("answer='' is invalid: expected a non-empty gold answer.", argument="answer",
                                    value=ans, allowed="a non-empty str or token ids")
        else:
            t = torch.as_tensor(ans)
            validate.tensor(t, name="answer", ndim=(0, 1), dtype="int")

    def needle_mask(self, length: int) -> Tensor:
        length = validate.integer(length, name="length", min=int(self.prompt_ids.shape[0]))
        m = torch.zeros(length, dtype=torch.bool)
        for s, e in self.evidence:
            m[s:e] = True
        return m

    def doc_mask(self, length: int) -> Tensor:
        length = validate.integer(length, name="length", min=int(self.prompt_ids.shape[0]))
        if self.gold_doc is None:
            return self.needle_mask(length)
        m = torch.zeros(length, dtype=torch.bool)
        m[self.gold_doc[0]:self.gold_doc[1]] = True
        return m


def _span(span: Any, n: int, name: str) -> tuple[int, int]:
    """A (start, end) token span with 0 <= start < end <= n (the prompt length)."""
    if isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2:
        raise ArgumentTypeError(f"{name}={span!r} is invalid: expected a (start, end) pair.", argument=name,
                                value=span, allowed="(start, end)")
    s = validate.integer(span[0], name=f"{name}[0]", min=0, max=n - 1, error=OutOfRangeError)
    return s, validate.integer(span[1], name=f"{name}[1]", min=s + 1, max=n, error=OutOfRangeError)


def from_qa_item(item: Any, tokenizer: Any = None) -> RetrievalItem:
    """A ``QAItem`` → ``RetrievalItem`` from one tokenisation with char offsets by ``tokenizer`` (the model's:
    ``model.tokenizer``): the needle is the answer occurrence in the gold passage (``evidence_span``), the
    gold doc its marker + sentence."""
    from mdm_lens.items import char_span_to_token_span

    if tokenizer is None:
        raise ArgumentError("tokenizer=None is invalid: a QAItem is text, so from_qa_item needs the tokenizer of "
                            "the model it is for (tokenizer=model.tokenizer).", argument="tokenizer", value=None,
                            allowed="a tokenizers.Tokenizer or transformers tokenizer")
    if hasattr(item, "check_spans"):  # fields assigned after construction are checked too
        item.check_spans()
    ids, off = encode_with_offsets(tokenizer, item.prompt)
    ev = [] if item.evidence_span is None else [char_span_to_token_span(off, item.evidence_span)]
    gold = None
    if item.gold_index is not None:
        s, e = item.passage_spans[item.gold_index]
        if item.marker_spans:
            s = item.marker_spans[item.gold_index][0]
        gold = char_span_to_token_span(off, (s, e))
    return RetrievalItem(torch.tensor(ids, dtype=torch.long), ev, item.answer, gold)


def _as_item(item: Any, model: Any) -> RetrievalItem:
    """A RetrievalItem as is; a QAItem tokenised by the model's own tokenizer (typed error without one)."""
    if isinstance(item, RetrievalItem):
        return item
    if not all(hasattr(item, f) for f in ("prompt", "answer", "passages")):  # e.g. a plain prompt string
        raise InputTypeError(f"items holds {validate.describe(item)}: retrieval needs items that say where the "
                             "answer is: a QAItem (prompt, passages, gold passage, answers; mdm_lens.items) or a "
                             "RetrievalItem (token ids, needle span, answer, gold span).", argument="items",
                             value=item, allowed="QAItem or RetrievalItem")
    return from_qa_item(item, model_tokenizer(model, "items", item, "RetrievalItem(s) of token ids"))


def _decode(model: Any, ids: Sequence[int]) -> str:
    from mdm_lens import tokenization

    tokenizer = model_tokenizer(model, "answer", "<text>", "the answer as token ids, or decode=")
    return tokenization.decode(tokenizer, list(ids))


def check_decode(decode: Any) -> Any:
    """`decode=`: None (the model's tokenizer) or a callable ids -> text; checked before any run."""
    if decode is not None and not callable(decode):
        from mdm_lens import validate
        from mdm_lens.errors import ArgumentTypeError

        raise ArgumentTypeError(f"decode={validate.describe(decode)} must be a callable ids -> text, or None (the "
                                "model's tokenizer).", argument="decode", value=decode, allowed="a callable or None")
    return decode


def answer_correct(model: Any, generated: Sequence[int] | Tensor, answer: Any, decode: Any = None) -> bool:
    """Text answer: normalised substring match of the decoded generation (SQuAD normalisation, as the AF
    Acc); token-id answer: the ids appear contiguously in the generated tokens."""
    gen = [int(t) for t in torch.as_tensor(generated).flatten()]
    if isinstance(answer, str):
        from mdm_lens.items import substring_match

        return bool(substring_match((decode or (lambda i: _decode(model, i)))(gen), answer))
    ans = [int(t) for t in torch.as_tensor(answer).flatten()]
    return any(gen[i:i + len(ans)] == ans for i in range(len(gen) - len(ans) + 1))


# ----------------------------------------------------------------------------------------------
# scores
# ----------------------------------------------------------------------------------------------

@dataclass
class RetrievalScores(ResultMixin):
    """Per-head scores (mean over counted samples; NaN if none counted).

    ``scores [layer, head]`` over ``layers``; ``per_sample [item, layer, head]`` (NaN for samples not counted:
    a wrong answer under ``only_correct``, or no answer position); ``above_threshold`` sorted by score;
    ``retrieval_heads`` = ``above_threshold`` except for ``evidence_focus``, which is never a retrieval score.
    """

    method: str
    threshold: float
    layers: list[int]
    scores: Tensor                      # [layer, head]
    per_sample: Tensor                  # [item, layer, head]  NaN where not counted
    correct: Tensor                     # [item] bool
    n_counted: int
    above_threshold: list[tuple[int, int]]
    retrieval_heads: list[tuple[int, int]]   # = above_threshold except for evidence_focus (never a retrieval score)
    notes: list[str] = field(default_factory=list)
    model_key: tuple | None = None      # `diffusion.output.model_key` of the model scored (ablation checks it)

    _dims: ClassVar = {"scores": ("layer", "head"), "per_sample": ("item", "layer", "head")}

    def top(self, k: int) -> list[tuple[int, int]]:
        """The k best heads (layer, head) by score (1 <= k <= number of scored heads; a NaN head is no rank)."""
        scored = int((~self.scores.isnan()).sum())
        if scored == 0:
            raise InputError(f"no head was scored (every score is NaN: {'; '.join(self.notes) or 'nothing counted'}),"
                             " so there is no top.", argument="k", value=k, allowed="a result with scored heads")
        k = validate.integer(k, name="k", min=1, max=scored)
        s = torch.nan_to_num(self.scores.to(torch.float64), nan=-1.0)
        order = torch.argsort(s.flatten(), descending=True, stable=True)[:k]
        return [(self.layers[int(i) // s.shape[1]], int(i) % s.shape[1]) for i in order]

    def to_frame(self, lead_dims=None, metrics=None) -> pd.DataFrame:
        """One row per head: method, layer, head, score, above_threshold, retrieval."""
        s = to_numpy(self.scores)
        rows = [dict(method=self.method, layer=self.layers[i], head=h, score=float(s[i, h]),
                     above_threshold=(self.layers[i], h) in self.above_threshold,
                     retrieval=(self.layers[i], h) in self.retrieval_heads)
                for i in range(s.shape[0]) for h in range(s.shape[1])]
        return pd.DataFrame(rows)
