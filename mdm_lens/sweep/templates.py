"""Prompt templates: a ``SweepItem`` → prompt text with character spans → token ids with offsets.

Templates (``--template``, default ``auto``):

- ``zoo``: the tiny twins' training layout (``mdm_lens.zoo.data``), ``<bos> [1] {p1} [2] {p2} ... question :
  {q} answer :``; the no-context variant drops the passages. A zoo item exported with ``mdm-lens zoo
  export`` renders to exactly the prompt ``zoo.data`` made for it.
- ``rag``: the paper's RAG layout (Attention-Floating §1.f): an instruction line, ``Context:`` with
  ``Passage i:\\n{text}`` for the first ``max_passages`` (5) passages, then ``Question: {q}\\nAnswer:``
  (LLaDA: ``Question: {q}\\n\\nShort Answer:``, as its released prompt). No passages → the placeholder
  ``No relevant context available.``; the no-context variant uses the placeholder too. Passages past
  ``max_passages`` are not shown: ``Rendered.dropped`` lists them (the sweep records it, and refuses an item
  whose gold passage would be dropped).
- ``chat``: the ``rag`` text as the user turn of the checkpoint's chat template (generation prompt added),
  read from ``chat_template.jinja`` / ``tokenizer_config.json`` by ``mdm_lens.chat`` (``tokenizer.json`` has
  none), or a transformers tokenizer's own. A model without one raises ``InputError`` naming ``template``.
- ``auto``: ``zoo`` for ``mdm_lens`` twins, ``chat`` where the checkpoint has a chat template, else ``rag``.

Plain ``{id, prompt}`` lines are used verbatim by every template (no spans, so the probes that need the
passages, ``retrieval`` and ``flow``, refuse them, and ``accuracy`` needs answers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from mdm_lens import tokenization
from mdm_lens.chat import has_chat_template, render_user_turn
from mdm_lens.errors import InputError
from mdm_lens.sweep.items import SweepItem
from mdm_lens import items as D

__all__ = ["TEMPLATES", "Rendered", "resolve_template", "render", "PLACEHOLDER"]

TEMPLATES = ("auto", "zoo", "rag", "chat")
PLACEHOLDER = "No relevant context available."
INSTRUCTION = ("Read the passages in the context and answer the question with a few words taken from them. "
               "If they do not contain the answer, answer from your own knowledge.")


@dataclass
class Rendered:
    """A prompt ready for the model. ``qa`` is a zoo ``QAItem`` (same fields and span conventions) when
    the item is a question: the probes that read regions use it. ``offsets`` are char offsets per token."""

    item: SweepItem
    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    qa: D.QAItem | None
    dropped: tuple[int, ...] = ()       # passage indices not shown (past ``max_passages``)


def resolve_template(model: Any, template: str) -> str:
    if template != "auto":
        return template
    if model.cfg.family == "mdm_lens":
        return "zoo"
    return "chat" if has_chat_template(model) else "rag"


def passages_shown(template: str, max_passages: int | None) -> int:
    """The resolved template's `max_passages` (default 5). The zoo prompt shows every passage, so a value given
    for it would change nothing: refused, as the sweep refuses other lengths its run would not use."""
    if max_passages is not None and template == "zoo":
        raise InputError(f"max_passages={max_passages}: the 'zoo' template shows every passage of an item (only the "
                         "'rag' / 'chat' prompts show the first max_passages); drop --max-passages, or pass "
                         "--template rag.", argument="max_passages", value=max_passages,
                         allowed="None under the 'zoo' template")
    return 5 if max_passages is None else max_passages


def _answer_span(passages: list[str], spans: list[tuple[int, int]], gold: tuple[int, ...],
                 answers: tuple[str, ...]) -> tuple[tuple[int, int], str] | None:
    """The needle: the earliest whole-word occurrence (in prompt order) of any gold answer inside any gold
    passage, and the answer it is; at one start the longest answer wins. Offsets are absolute (prompt chars):
    comparing a passage-relative start with an absolute one would let a later answer win."""
    best = None
    for g in gold:
        start = spans[g][0]
        for a in answers:
            m = re.search(r"(?<!\w)" + re.escape(a.strip()) + r"(?!\w)", passages[g], flags=re.I)
            if m is None:
                continue
            key = (start + m.start(), -(m.end() - m.start()))
            if best is None or key < best[0]:
                best = (key, (start + m.start(), start + m.end()), a)
    return None if best is None else (best[1], best[2])


class _Builder:
    """Appends text pieces and remembers their char spans."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.pos = 0

    def add(self, text: str) -> tuple[int, int]:
        start = self.pos
        self.parts.append(text)
        self.pos += len(text)
        return (start, self.pos)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _qa_item(item: SweepItem, b: _Builder, passages: list[str], p_spans: list, m_spans: list,
             q_span: tuple[int, int], prefix: str, gold: tuple[int, ...]) -> D.QAItem:
    """``answer`` is the answer the evidence span points at (the first answer when none is found)."""
    found = _answer_span(passages, p_spans, gold, item.answers) if gold else None
    ev, answer = (None, item.answers[0] if item.answers else "") if found is None else found
    answers = tuple(dict.fromkeys((answer, *item.answers))) if answer else item.answers
    return D.QAItem(question=item.question or "", answer=answer, passages=passages, gold_index=None,
                    gold_indices=gold, prompt=b.text, passage_spans=p_spans, question_span=q_span, evidence_span=ev,
                    answer_prefix=prefix, marker_spans=m_spans, answers=answers)


def _zoo(item: SweepItem, context: bool) -> D.QAItem:
    b = _Builder()
    b.add(D.BOS)
    passages = list(item.passages) if context else []
    p_spans, m_spans = [], []
    for i, p in enumerate(passages):
        b.add(" ")
        m_spans.append(b.add(D.passage_marker(i + 1)))
        b.add(" ")
        p_spans.append(b.add(p))
    b.add(" " + D.QUESTION_CUE + " ")
    q_span = b.add(item.question or "")
    b.add(" ")
    b.add(D.ANSWER_PREFIX)
    return _qa_item(item, b, passages, p_spans, m_spans, q_span, D.ANSWER_PREFIX, item.gold_indices if context else ())


def _rag(item: SweepItem, context: bool, family: str, max_passages: int) -> D.QAItem:
    b = _Builder()
    b.add(INSTRUCTION + "\n\nContext:\n")
    real = list(item.passages[:max_passages]) if context else []
    shown = real or [PLACEHOLDER]
    p_spans, m_spans = [], []
    for i, p in enumerate(shown):
        m_spans.append(b.add(f"Passage {i + 1}:"))
        b.add("\n")
        p_spans.append(b.add(p))
        b.add("\n")
    b.add("\nQuestion: ")
    q_span = b.add(item.question or "")
    prefix = "Short Answer:" if family == "llada" else "Answer:"
    b.add("\n\n" if family == "llada" else "\n")
    b.add(prefix)
    gold = tuple(g for g in item.gold_indices if g < len(real)) if context else ()
    qa = _qa_item(item, b, shown if real else [], p_spans if real else [], m_spans if real else [], q_span,
                  prefix, gold)
    return qa


def _shift(qa: D.QAItem, text: str, offset: int) -> D.QAItem:
    """Move every span of ``qa`` by ``offset`` chars (its prompt placed inside a chat template)."""
    mv = lambda s: None if s is None else (s[0] + offset, s[1] + offset)  # noqa: E731
    return replace(qa, prompt=text, passage_spans=[mv(s) for s in qa.passage_spans],
                   marker_spans=[mv(s) for s in qa.marker_spans], question_span=mv(qa.question_span),
                   evidence_span=mv(qa.evidence_span))


def encode_with_offsets(model: Any, text: str, template: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and char offsets of ONE tokenisation (regions and needles come from these offsets)."""
    tok = tokenization.require(model.tokenizer)
    if hasattr(tok, "encode_batch"):  # tokenizers.Tokenizer
        enc = tok.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), [tuple(o) for o in enc.offsets]
    else:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    bos = model.cfg.bos_token_id
    if template == "rag" and bos is not None and model.cfg.extra.get("prepend_bos", True) and ids[:1] != [bos]:
        ids, offsets = [bos] + ids, [(0, 0)] + offsets
    return ids, offsets


def render(model: Any, item: SweepItem, template: str, context: bool = True, max_passages: int = 5) -> Rendered:
    """The prompt of ``item`` (``context=False``: its closed-book variant) under ``template`` (resolved)."""
    if not item.is_qa:
        ids, off = encode_with_offsets(model, item.prompt or "", "plain")
        return Rendered(item, item.prompt or "", ids, off, None)
    if template == "zoo":
        qa = _zoo(item, context)
    else:
        qa = _rag(item, context, model.cfg.family, max_passages)
        if template == "chat":
            full = render_user_turn(model, qa.prompt)
            at = full.find(qa.prompt)
            if at < 0:      # the template rewrote the text: no span could be placed, so refuse (never drop them)
                raise InputError("the checkpoint's chat template changes the user text (e.g. trims or escapes it), "
                                 f"so the passage and question spans of item {item.id!r} cannot be placed in it; "
                                 "use --template rag.", argument="template", value=template, allowed="rag")
            qa = _shift(qa, full, at)
    ids, off = encode_with_offsets(model, qa.prompt, template)
    shown = len(item.passages) if template == "zoo" or not context else max_passages
    return Rendered(item, qa.prompt, ids, off, qa, tuple(range(shown, len(item.passages))))
