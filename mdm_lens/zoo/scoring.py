"""Zoo data, part 3: SQuAD-style answer scoring (normalise, exact match, substring match, token F1)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

from mdm_lens.zoo.pools import QAItem

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
    """Mean exact match, substring match and token F1 of predictions against items."""
    preds = list(preds)
    if len(preds) != len(items):
        raise ValueError(f"{len(preds)} predictions for {len(items)} items")
    n = len(items)
    if n == 0:
        return {"exact_match": 0.0, "substring_match": 0.0, "f1": 0.0, "n": 0.0}
    em = sum(exact_match(p, it.answer) for p, it in zip(preds, items))
    sm = sum(substring_match(p, it.answer) for p, it in zip(preds, items))
    f1 = sum(token_f1(p, it.answer) for p, it in zip(preds, items))
    return {"exact_match": em / n, "substring_match": sm / n, "f1": f1 / n, "n": float(n)}
