"""Sweep input: one item per jsonl line, in the KILT / Attention-Floating layout or as plain ``{id, prompt}``.

Accepted keys (aliases of one field may appear together only with equal values; different values are an error):

- question: ``input``, ``question``, ``query``
- passages: ``passage`` / ``passages`` / ``ctxs`` as a list of strings or of objects with ``segment`` /
  ``text`` / ``passage`` (and an optional ``title``); a single string is one passage; an empty passage is an error
- answers: ``output`` / ``answer`` / ``answers`` as a string, a list of strings, or objects with
  ``answer`` / ``text`` (KILT's ``output: [{answer: ...}]``); a list of such lists is flattened. Several keys
  (``answer`` plus ``answers``, as TriviaQA-style files have) are joined: every accepted answer is kept, in
  key order, without repeats
- gold passages: ``gold_index`` / ``gold_idx`` / ``gold_position`` (0-based, an int or a list of ints); or passage
  objects with ``gold`` / ``is_gold`` / ``has_answer`` true. Several gold passages are all gold
  (``SweepItem.gold_indices``). Markers that disagree (an explicit index other than the flagged passages, or
  ``gold: true`` with ``is_gold: false`` on one passage) are an error, never a silent pick
- id: ``id`` / ``_id`` / ``qid`` (default: ``line{N}``, 1-based line number)
- plain prompts: ``{"id": ..., "prompt": "..."}`` (no question; the prompt is used as it is). A line with both a
  ``prompt`` and a question is an error (which one would run is not clear)

A malformed line raises :class:`mdm_lens.errors.InputError` naming the file and the line; with
``skip_bad=True`` it is skipped and recorded in ``ReadResult.skipped`` (line number and reason).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.items import gold_set

__all__ = ["SweepItem", "ReadResult", "read_items", "parse_item"]

QUESTION_KEYS = ("input", "question", "query")
PASSAGE_KEYS = ("passage", "passages", "ctxs")
ANSWER_KEYS = ("output", "answer", "answers")
GOLD_KEYS = ("gold_index", "gold_idx", "gold_position")
GOLD_FLAGS = ("gold", "is_gold", "has_answer")
ID_KEYS = ("id", "_id", "qid")


@dataclass(frozen=True)
class SweepItem:
    """One parsed input line. ``prompt`` is set for plain-prompt lines (then ``question`` is None).

    ``gold_indices`` is the gold SET (sorted); ``gold_index`` its smallest member (None without gold), kept for
    single-gold readers. Either may be given; they are made consistent here."""

    id: str
    line: int
    question: str | None = None
    passages: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    gold_index: int | None = None
    prompt: str | None = None
    gold_indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        gold = gold_set(self.gold_index, self.gold_indices)
        object.__setattr__(self, "gold_indices", gold)
        object.__setattr__(self, "gold_index", gold[0] if gold else None)

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


def _short(v: Any, n: int = 60) -> str:
    text = json.dumps(v)
    return text if len(text) <= n else text[:n - 3] + "..."


def _one(obj: dict, keys: tuple[str, ...], what: str) -> Any:
    """The value of the alias keys of one field; aliases present with different values are an error."""
    present = [(k, obj[k]) for k in keys if k in obj and obj[k] is not None]
    for k, v in present[1:]:
        if v != present[0][1]:
            raise _Bad(f"conflicting {what}: {present[0][0]}={_short(present[0][1])} and {k}={_short(v)}")
    return present[0][1] if present else None


def _text(v: Any, keys: tuple[str, ...], what: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        for k in keys:
            if isinstance(v.get(k), str):
                return v[k]
    raise _Bad(f"{what} must be a string or an object with one of {list(keys)}, got {_short(v, 80)}")


def _flag(p: dict, i: int) -> bool | None:
    """A passage object's gold flag: True / False where flagged, None where not; flags that disagree: error."""
    flags = {}
    for k in GOLD_FLAGS:
        v = p.get(k)
        if isinstance(v, bool) or v in (0, 1) and isinstance(v, int):  # 1 / 0 are the datasets' usual booleans
            flags[k] = bool(v)
        elif v is not None:  # "true", 2, [..]: never read as "not flagged"
            raise _Bad(f"passage {i}'s {k}={_short(v)} is not a gold flag (true / false, or 1 / 0)")
    if len(set(flags.values())) > 1:
        raise _Bad(f"conflicting gold markers on passage {i}: " + ", ".join(f"{k}={v}" for k, v in flags.items()))
    return next(iter(flags.values())) if flags else None


def _passages(raw: Any) -> tuple[tuple[str, ...], dict[int, bool]]:
    """Passage texts and the gold flags they carry (passage index → flag, flagged passages only)."""
    if raw is None:
        return (), {}
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        raise _Bad(f"passages must be a list, got {type(raw).__name__}")
    texts, flags = [], {}
    for i, p in enumerate(raw):
        body = _text(p, ("segment", "text", "passage", "content"), f"passage {i}")
        if not body.strip():  # checked before a title is prepended, which would hide an empty text
            raise _Bad(f"passage {i} is empty")
        if isinstance(p, dict):
            if isinstance(p.get("title"), str) and p["title"]:
                body = f"{p['title']}: {body}"
            f = _flag(p, i)
            if f is not None:
                flags[i] = f
        texts.append(body)
    return tuple(texts), flags


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


def _all_answers(obj: dict) -> tuple[str, ...]:
    """Every answer under every answer key, in key order, without repeats (nothing is dropped)."""
    out: list[str] = []
    for k in ANSWER_KEYS:
        for a in _answers(obj.get(k)):
            if a not in out:
                out.append(a)
    return tuple(out)


def _explicit_gold(obj: dict, n: int) -> tuple[int, ...] | None:
    raw = _one(obj, GOLD_KEYS, "gold passage indices")
    if raw is None:
        return None
    values = raw if isinstance(raw, list) else [raw]
    if not values or any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < n for g in values):
        allowed = f"a passage index in 0..{n - 1}" if n else "none: the item has no passages"
        raise _Bad(f"gold index {_short(raw)} is invalid ({allowed})")
    return tuple(sorted(set(values)))


def _gold(obj: dict, n: int, flags: dict[int, bool]) -> tuple[int, ...]:
    explicit = _explicit_gold(obj, n)
    flagged = tuple(i for i, f in sorted(flags.items()) if f)
    if explicit is None:
        return flagged
    denied = [i for i in explicit if flags.get(i) is False]
    if (flagged and flagged != explicit) or denied:
        raise _Bad(f"conflicting gold markers: the gold index says {list(explicit)} but the passages flag "
                   f"{list(flagged)} as gold" + (f" and {denied} as not gold" if denied else ""))
    return explicit


def parse_item(obj: Any, line: int) -> SweepItem:
    """One decoded json line → a ``SweepItem`` (raises ``_Bad`` with the reason)."""
    if not isinstance(obj, dict):
        raise _Bad(f"expected a json object, got {type(obj).__name__}")
    raw_id = _one(obj, ID_KEYS, "ids")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
        raise _Bad(f"id must be a string or an integer, got {_short(raw_id, 40)}")
    item_id = f"line{line}" if raw_id is None else str(raw_id)
    question = _one(obj, QUESTION_KEYS, "questions")
    prompt = obj.get("prompt")
    if question is None:
        if prompt is None:
            raise _Bad(f"no question ({'/'.join(QUESTION_KEYS)}) and no prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _Bad(f"the prompt must be a non-empty string, got {_short(prompt, 40)}")
        if any(k in obj for k in PASSAGE_KEYS + GOLD_KEYS):
            raise _Bad("a plain prompt line cannot carry passages or a gold index (they would not be shown)")
        return SweepItem(id=item_id, line=line, prompt=prompt, answers=_all_answers(obj))
    if prompt is not None:
        raise _Bad("the line has both a prompt and a question; give one (a plain prompt, or a QA item)")
    if not isinstance(question, str) or not question.strip():
        raise _Bad("the question must be a non-empty string")
    passages, flags = _passages(_one(obj, PASSAGE_KEYS, "passages"))
    gold = _gold(obj, len(passages), flags)
    return SweepItem(id=item_id, line=line, question=question.strip(), passages=passages,
                     answers=_all_answers(obj), gold_indices=gold)


def _decode_line(raw: bytes, n: int) -> str:
    """One line as text: UTF-8 (a BOM opening the file is dropped; CRLF endings are json whitespace). Each line is
    decoded on its own so that a Latin-1 byte names its line and `--skip-bad` can skip just that line."""
    bom = 3 if n == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
    raw = raw[bom:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:  # the byte is counted in the line as it is in the file, BOM included
        raise _Bad(f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + bom + 1} of the line; re-save the file "
                   "as UTF-8)") from None


def read_items(path: str | Path, skip_bad: bool = False) -> ReadResult:
    """Read every line of a UTF-8 jsonl file (blank lines ignored; a leading BOM and CRLF endings accepted); ids
    must be unique. A bad line (not UTF-8, not json, not an item, a duplicate id) raises `InputError` naming the
    file and line, or with `skip_bad` is recorded in `skipped` with its reason."""
    if not isinstance(path, (str, os.PathLike)):  # a list of items in memory: the sweep reads (and resumes) a file
        raise ArgumentTypeError(f"data={validate.describe(path)} is invalid: expected the path of a .jsonl file of "
                                "items (one json object per line, e.g. {\"id\": \"q1\", \"prompt\": ...}); write "
                                "items held in memory to such a file first.", argument="data", value=path,
                                allowed="a str or os.PathLike path to a .jsonl file")
    path = Path(path)
    if validate.path_kind(path, name="data") == "dir":
        raise InputError(f"--data {str(path)!r} is a directory: expected a .jsonl file.", argument="data",
                         value=str(path), allowed="a .jsonl file")
    if not path.is_file():
        raise InputError(f"--data {str(path)!r}: no such file.", argument="data", value=str(path))
    items, skipped, seen = [], [], {}
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = _decode_line(raw, n)
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text.rstrip("\r\n"))  # the line's end is no json: columns count on the line
                except json.JSONDecodeError as e:
                    raise _Bad(f"not valid json ({e.msg} at column {e.colno})") from None
                try:  # a lone surrogate escape ("\\ud800") parses but is no text a tokenizer can read
                    json.dumps(obj, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError as e:
                    raise _Bad(f"holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), which is not "
                               "text") from None
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
