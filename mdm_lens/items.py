"""The library's prompt-with-regions data model and the answer-scoring helpers every probe shares.

Why here and not in the zoo: probes, sweep templates and real-data loaders all read one item type; the toy zoo is
one producer of it (``mdm_lens.zoo`` imports this module, never the reverse), so analysing real data never goes
through a toy package.

* ``QAItem`` -- a rendered prompt plus half-open character spans of its regions: each passage (without its
  ``[k]`` marker), each marker, the question, and the answer occurrence inside the gold passage
  (``evidence_span``). ``gold_indices`` is the gold SET (several passages may all be gold); ``gold_index`` is
  its first member, kept for single-gold callers. ``char_span_to_token_span`` maps any span to the token range
  of one tokenisation, so regions land on exactly the positions the model sees.
* Template literals shared by every renderer (``BOS``, ``QUESTION_CUE``, ``ANSWER_PREFIX``, ``passage_marker``).
* SQuAD-style scoring (``normalize``, ``exact_match``, ``substring_match``, ``token_f1``, ``score``: the best of an
  item's accepted answers), so numbers are comparable with the usual RAG-QA literature.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mdm_lens.errors import InputError

__all__ = ["QAItem", "BOS", "EOS", "QUESTION_CUE", "ANSWER_PREFIX", "passage_marker", "char_span_to_token_span",
           "normalize", "exact_match", "substring_match", "token_f1", "score"]

BOS, EOS = "<bos>", "<eos>"
QUESTION_CUE = "question :"
#: The text the answer follows at the very end of every prompt.
ANSWER_PREFIX = "answer :"


def passage_marker(k: int) -> str:
    """Marker for the k-th passage (1-based), a single token such as ``[3]``."""
    return f"[{k}]"


def gold_set(gold_index: int | None, gold_indices: Sequence[int]) -> tuple[int, ...]:
    """One sorted gold set from the two fields a producer may fill; `gold_index` must be its smallest member."""
    gold = tuple(sorted({int(g) for g in gold_indices}))
    if gold_index is not None and not gold:
        gold = (int(gold_index),)
    if gold and gold_index is not None and int(gold_index) != gold[0]:
        raise InputError(f"gold_index={gold_index!r} is not the smallest of gold_indices={gold!r}",
                         argument="gold_index", value=gold_index, allowed=f"min(gold_indices) = {gold[0]}")
    return gold


@dataclass
class QAItem:
    """One QA example plus everything analysis code needs to locate prompt regions.

    All spans are half-open character offsets into ``prompt`` (``prompt[s:e]``).
    ``passages[i]`` is the i-th passage sentence without its ``[i+1]`` marker, and
    ``prompt[passage_spans[i][0]:passage_spans[i][1]] == passages[i]``.

    ``answers`` holds every accepted answer (``answer`` is the first, the one the evidence span points at) and
    ``gold_indices`` every gold passage; both default to the single ``answer`` / ``gold_index`` so items built with
    one of each (the zoo's) are unchanged, and ``gold_index`` is always the smallest gold index.
    """

    question: str
    answer: str
    passages: list[str]
    gold_index: int | None
    prompt: str
    passage_spans: list[tuple[int, int]]
    question_span: tuple[int, int]
    evidence_span: tuple[int, int] | None
    answer_prefix: str = ANSWER_PREFIX
    marker_spans: list[tuple[int, int]] = field(default_factory=list)
    relation: str = ""
    subject: str = ""
    answers: tuple[str, ...] = ()
    gold_indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Why normalise here: every reader then sees one gold set, whichever of the two fields a producer filled.
        gold = gold_set(self.gold_index, self.gold_indices)
        bad = [g for g in gold if not 0 <= g < len(self.passages)]
        if bad:
            raise InputError(f"gold_indices={gold!r}: {bad} outside the {len(self.passages)} passages",
                             argument="gold_indices", value=gold, allowed=f"indices in [0, {len(self.passages)})")
        self.gold_indices = gold
        self.gold_index = gold[0] if gold else None
        self.check_spans()
        if not self.answers and self.answer:
            self.answers = (self.answer,)
        self.answers = tuple(self.answers)

    def check_spans(self) -> None:
        """Every span a half-open (start, end) inside ``[0, len(prompt)]`` with start <= end, one passage span
        (and one marker span, when there are any) per passage. Why here: regions are built from these offsets, and
        a span past the prompt's end or one span for two passages silently merges or drops regions."""
        n, k = len(self.prompt), len(self.passages)
        for name, spans in (("passage_spans", self.passage_spans), ("marker_spans", self.marker_spans)):
            if name == "passage_spans" or spans:
                self._span_count(name, spans, k)
            for i, span in enumerate(spans):
                self._span(f"{name}[{i}]", span, n)
        self._span("question_span", self.question_span, n)
        if self.evidence_span is not None:
            self._span("evidence_span", self.evidence_span, n)

    def _label(self) -> str:
        q = self.question if len(self.question) <= 40 else self.question[:37] + "..."
        return f"item with question {q!r}"

    def _span_count(self, name: str, spans: object, k: int) -> None:
        if not isinstance(spans, (list, tuple)) or len(spans) != k:
            got = len(spans) if isinstance(spans, (list, tuple)) else type(spans).__name__
            raise InputError(f"{name} of the {self._label()} has {got} span(s) for its {k} passage(s): one span per "
                             "passage.", argument=name, value=spans, allowed=f"{k} (start, end) spans")

    def _span(self, name: str, span: object, n: int) -> None:
        ok = isinstance(span, (tuple, list)) and len(span) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in span)
        if ok and 0 <= span[0] <= span[1] <= n:
            return
        why = ("not a (start, end) pair of ints" if not ok else "reversed (start > end)" if span[0] > span[1]
               else f"outside the prompt's {n} characters")
        raise InputError(f"{name}={span!r} of the {self._label()} is invalid: {why}; spans are half-open character "
                         f"offsets with 0 <= start <= end <= len(prompt) = {n}.", argument=name, value=span,
                         allowed=f"(start, end) with 0 <= start <= end <= {n}")

    def token_spans(self, offsets: Sequence[tuple[int, int]]) -> dict[str, object]:
        """Half-open token ranges of every region for one tokenisation's per-token char ``offsets``:
        ``{"question": (s, e), "passages": [(s, e), ...], "markers": [...], "evidence": (s, e) | None}``."""
        return {"question": char_span_to_token_span(offsets, self.question_span),
                "passages": [char_span_to_token_span(offsets, s) for s in self.passage_spans],
                "markers": [char_span_to_token_span(offsets, s) for s in self.marker_spans],
                "evidence": None if self.evidence_span is None else char_span_to_token_span(offsets, self.evidence_span)}

    @property
    def n_distractors(self) -> int:
        """Number of non-gold passages (0 for no-context items)."""
        return max(len(self.passages) - 1, 0)


# --------------------------------------------------------------------------------------
# Scoring (SQuAD-style)
# --------------------------------------------------------------------------------------

_SPECIAL_RE = re.compile(r"<(?:pad|bos|eos|mask|unk)>")
_ARTICLES_RE = re.compile(r"\b(?:a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles, collapse spaces.

    Special-token strings (``<eos>``, ``<pad>``, ...) are removed first so a decoded
    generation that ran into ``<eos>`` still scores on its words.
    """
    text = _SPECIAL_RE.sub(" ", text.lower())
    text = text.translate(_PUNCT_TABLE)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def exact_match(pred: str, gold: str) -> float:
    """1.0 iff the normalised prediction equals the normalised gold answer."""
    return float(normalize(pred) == normalize(gold))


def substring_match(pred: str, gold: str) -> float:
    """1.0 iff the normalised gold appears (word-aligned) in the normalised prediction.

    Lenient "accuracy" used in RAG papers: a verbose but correct answer counts.
    Matching is on word boundaries so gold "red" does not match pred "kelmired".
    """
    g, p = normalize(gold), normalize(pred)
    if not g:
        return float(not p)
    return float(f" {g} " in f" {p} ")


def token_f1(pred: str, gold: str) -> float:
    """SQuAD token-level F1 between normalised prediction and gold."""
    p, g = normalize(pred).split(), normalize(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def score(preds: Iterable[str], items: Sequence[QAItem]) -> dict[str, float]:
    """Mean exact match, substring match and token F1 of predictions against items; an item with several
    accepted answers (``QAItem.answers``) scores its best one, as SQuAD does. No items: every mean is NaN
    (undefined, not 0) and ``n`` is 0."""
    preds = list(preds)
    if len(preds) != len(items):
        raise InputError(f"{len(preds)} predictions for {len(items)} items", argument="preds", value=len(preds),
                         allowed=f"{len(items)} predictions, one per item")
    n = len(items)
    if n == 0:
        return {"exact_match": math.nan, "substring_match": math.nan, "f1": math.nan, "n": 0.0}
    golds = [it.answers or (it.answer,) for it in items]
    em = sum(max(exact_match(p, a) for a in g) for p, g in zip(preds, golds))
    sm = sum(max(substring_match(p, a) for a in g) for p, g in zip(preds, golds))
    f1 = sum(max(token_f1(p, a) for a in g) for p, g in zip(preds, golds))
    return {"exact_match": em / n, "substring_match": sm / n, "f1": f1 / n, "n": float(n)}


def char_span_to_token_span(
    offsets: Sequence[tuple[int, int]], span: tuple[int, int]
) -> tuple[int, int]:
    """Half-open token range ``[start_tok, end_tok)`` of tokens overlapping ``span``.

    A token overlaps when ``tok_start < span_end`` and ``tok_end > span_start``;
    raises ``ValueError`` if no token does (e.g. a span over whitespace only).
    """
    s, e = span
    hits = [i for i, (ts, te) in enumerate(offsets) if ts < e and te > s]
    if not hits:
        raise ValueError(f"no token overlaps char span {span}")
    return hits[0], hits[-1] + 1
