"""Token regions of a zoo `QAItem` (BOS, passages, question, cues, answer, padding) from the character offsets of
one tokenisation of its prompt: what `flow_for_items` pools attention over (specs/probes_and_paper.md §3.8)."""

from __future__ import annotations

from typing import Any, Sequence

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

from . import flow as F


def _item_char_spans(item: Any) -> list[F.CharSpan]:
    """BOS / docs (marker + sentence; the gold one kind ``gold``) / question cue / query / answer cue."""
    from mdm_lens import items as D

    if hasattr(item, "check_spans"):  # again here: an item's fields may have been assigned after it was built
        item.check_spans()
    p = item.prompt
    spans = [F.CharSpan("bos", 0, len(D.BOS), "bos")] if p.startswith(D.BOS) else []
    markers = item.marker_spans or [None] * len(item.passage_spans)
    for i, (ps, mk) in enumerate(zip(item.passage_spans, markers)):
        start = ps[0] if mk is None else mk[0]
        spans.append(F.CharSpan(f"doc{i + 1}", start, ps[1], "gold" if i in getattr(item, "gold_indices", (item.gold_index,)) else "doc"))
    q0, q1 = item.question_span
    cue = p.rfind(D.QUESTION_CUE, 0, q0)
    if cue >= 0:
        spans.append(F.CharSpan("question_cue", cue, cue + len(D.QUESTION_CUE), "template"))
    spans.append(F.CharSpan("query", q0, q1, "query"))
    ans = p.find(item.answer_prefix, q1)
    if ans >= 0:
        spans.append(F.CharSpan("answer_cue", ans, ans + len(item.answer_prefix), "template"))
    return spans


def regions_for_item(item: Any, answer_length: int = 0, offsets: Sequence[tuple[int, int]] | None = None,
                     total_length: int | None = None, answer_span: tuple[int, int] | None = None) -> list[F.Region]:
    """Token regions of a zoo ``QAItem`` from the char offsets of ONE tokenisation of its prompt (§3.8).

    Regions: ``bos``, ``doc{i}`` (kind ``gold`` for the gold passage, ``doc`` otherwise; each includes its
    ``[i]`` marker), ``question_cue`` / ``answer_cue`` (kind ``template``), ``query``, then ``answer``
    (``answer_span``, default the ``answer_length`` tokens after the prompt) and ``pad`` up to
    ``total_length``; any gap is an explicit ``other`` region (nothing is dropped).
    """
    answer_length = validate.integer(answer_length, name="answer_length", min=0)
    if offsets is None:
        raise ArgumentError("offsets=None is invalid: regions come from the per-token character offsets of the "
                            "tokenisation the model saw; pass offsets=probes._text.encode_with_offsets("
                            "model.tokenizer, item.prompt)[1].", argument="offsets", value=None,
                            allowed="a list of (start, end) character offsets, one per token")
    regs = F.regions_from_char_spans(_item_char_spans(item), offsets)
    n = len(offsets)
    if answer_span is not None:
        if not isinstance(answer_span, (tuple, list)) or len(answer_span) != 2:
            raise ArgumentTypeError(f"answer_span={validate.describe(answer_span)} is invalid: expected a (start, end) "
                                    "pair of token positions.", argument="answer_span", value=answer_span,
                                    allowed="(start, end)")
        a0 = validate.integer(answer_span[0], name="answer_span[0]", min=0)
        validate.integer(answer_span[1], name="answer_span[1]", min=a0)
    a0, a1 = answer_span if answer_span is not None else (n, n + answer_length)
    if total_length is not None:
        validate.integer(total_length, name="total_length", min=max(a1, n))
    if a1 > a0:
        regs.append(F.Region("answer", a0, a1, "answer"))
    end = max(a1, n)
    total = end if total_length is None else total_length
    if total > end:
        regs.append(F.Region("pad", end, total, "pad"))
    return F.complete_regions(regs, total)
