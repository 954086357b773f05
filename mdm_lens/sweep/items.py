"""Sweep input: one item per jsonl line, in the KILT / Attention-Floating layout or as plain ``{id, prompt}``.

Accepted keys (first one present wins):

- question: ``input``, ``question``, ``query``
- passages: ``passage`` / ``passages`` / ``ctxs`` as a list of strings or of objects with ``segment`` /
  ``text`` / ``passage`` (and an optional ``title``); a single string is one passage
- answers: ``output`` / ``answer`` / ``answers`` as a string, a list of strings, or objects with
  ``answer`` / ``text`` (KILT's ``output: [{answer: ...}]``); a list of such lists is flattened
- gold passage index: ``gold_index`` / ``gold_idx`` / ``gold_position`` (0-based); or a passage object with
  ``gold: true`` / ``is_gold: true`` / ``has_answer: true``
- id: ``id`` / ``_id`` / ``qid`` (default: ``line{N}``, 1-based line number)
- plain prompts: ``{"id": ..., "prompt": "..."}`` (no question; the prompt is used as it is)

A malformed line raises :class:`mdm_lens.errors.InputError` naming the file and the line; with
``skip_bad=True`` it is skipped and recorded in ``ReadResult.skipped`` (line number and reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mdm_lens.errors import InputError

__all__ = ["SweepItem", "ReadResult", "read_items", "parse_item"]

QUESTION_KEYS = ("input", "question", "query")
PASSAGE_KEYS = ("passage", "passages", "ctxs")
ANSWER_KEYS = ("output", "answer", "answers")
GOLD_KEYS = ("gold_index", "gold_idx", "gold_position")
ID_KEYS = ("id", "_id", "qid")


@dataclass(frozen=True)
class SweepItem:
    """One parsed input line. ``prompt`` is set for plain-prompt lines (then ``question`` is None)."""

    id: str
    line: int
    question: str | None = None
    passages: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    gold_index: int | None = None
    prompt: str | None = None

    @property
    def is_qa(self) -> bool:
        return self.question is not None


@dataclass
class ReadResult:
    items: list[SweepItem]
    skipped: list[dict[str, Any]] = field(default_factory=list)   # {"line": n, "reason": "..."}
    path: str = ""


class _Bad(Exception):
    pass


def _first(obj: dict, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if k in obj and obj[k] is not None:
            return obj[k]
    return None


def _text(v: Any, keys: tuple[str, ...], what: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        for k in keys:
            if isinstance(v.get(k), str):
                return v[k]
    raise _Bad(f"{what} must be a string or an object with one of {list(keys)}, got {json.dumps(v)[:80]}")


def _passages(raw: Any) -> tuple[tuple[str, ...], int | None]:
    if raw is None:
        return (), None
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        raise _Bad(f"passages must be a list, got {type(raw).__name__}")
    texts, gold = [], None
    for i, p in enumerate(raw):
        body = _text(p, ("segment", "text", "passage", "content"), f"passage {i}")
        if isinstance(p, dict):
            if isinstance(p.get("title"), str) and p["title"]:
                body = f"{p['title']}: {body}"
            if any(p.get(k) is True for k in ("gold", "is_gold", "has_answer")) and gold is None:
                gold = i
        texts.append(body)
    return tuple(texts), gold


def _answers(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raw = [raw]
    out: list[str] = []
    for a in raw:
        if isinstance(a, list):
            out.extend(_answers(a))
        elif isinstance(a, dict) and not any(isinstance(a.get(k), str) for k in ("answer", "text")):
            continue  # KILT provenance-only entries carry no answer string
        else:
            out.append(_text(a, ("answer", "text"), "answer"))
    return tuple(s for s in out if s.strip())


def parse_item(obj: Any, line: int) -> SweepItem:
    """One decoded json line → a ``SweepItem`` (raises ``_Bad`` with the reason)."""
    if not isinstance(obj, dict):
        raise _Bad(f"expected a json object, got {type(obj).__name__}")
    raw_id = _first(obj, ID_KEYS)
    if raw_id is not None and not isinstance(raw_id, (str, int)):
        raise _Bad(f"id must be a string or an integer, got {json.dumps(raw_id)[:40]}")
    item_id = f"line{line}" if raw_id is None else str(raw_id)
    question = _first(obj, QUESTION_KEYS)
    if question is None:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _Bad(f"no question ({'/'.join(QUESTION_KEYS)}) and no prompt")
        return SweepItem(id=item_id, line=line, prompt=prompt, answers=_answers(_first(obj, ANSWER_KEYS)))
    if not isinstance(question, str) or not question.strip():
        raise _Bad("the question must be a non-empty string")
    passages, gold = _passages(_first(obj, PASSAGE_KEYS))
    explicit = _first(obj, GOLD_KEYS)
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or not 0 <= explicit < max(len(passages), 1):
            raise _Bad(f"gold index {explicit!r} is not a passage index in 0..{len(passages) - 1}")
        gold = explicit
    return SweepItem(id=item_id, line=line, question=question.strip(), passages=passages,
                     answers=_answers(_first(obj, ANSWER_KEYS)), gold_index=gold if passages else None)


def read_items(path: str | Path, skip_bad: bool = False) -> ReadResult:
    """Read every line of a jsonl file (blank lines ignored); ids must be unique."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--data {str(path)!r}: no such file.")
    items, skipped, seen = [], [], {}
    with path.open(encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise _Bad(f"not valid json ({e.msg} at column {e.colno})") from None
                item = parse_item(obj, n)
                if item.id in seen:
                    raise _Bad(f"duplicate id {item.id!r} (first on line {seen[item.id]})")
            except _Bad as e:
                if not skip_bad:
                    raise InputError(f"{path}:{n}: {e} (use --skip-bad to skip malformed lines)") from None
                skipped.append({"line": n, "reason": str(e)})
                continue
            seen[item.id] = n
            items.append(item)
    return ReadResult(items=items, skipped=skipped, path=str(path))
