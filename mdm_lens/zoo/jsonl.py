"""The zoo's synthetic QA items as KILT-style jsonl (``mdm-lens zoo export``), readable by ``mdm-lens sweep``.

One line per item: ``{"id", "question", "passages": [{"segment"}], "answers": [...], "gold_index"}``; the
sweep's ``zoo`` template renders it back to exactly ``item.prompt``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from mdm_lens.zoo import data as D

__all__ = ["to_record", "export"]


def to_record(item: D.QAItem, item_id: str) -> dict[str, Any]:
    return {"id": item_id, "question": item.question, "passages": [{"segment": p} for p in item.passages],
            "answers": [item.answer], "gold_index": item.gold_index}


def export(path: str | Path, n: int, seed: int, n_distractors: int = 4, gold_position: D.GoldPosition = "random",
           no_context: bool = False) -> list[D.QAItem]:
    """Write ``make_dataset(n, seed, ...)`` to ``path`` (ids ``zoo-{seed}-{i}``) and return the items."""
    items = D.make_dataset(n, seed=seed, n_distractors=n_distractors, gold_position=gold_position,
                           no_context=no_context)
    write(path, items, [f"zoo-{seed}-{i:05d}" for i in range(n)])
    return items


def write(path: str | Path, items: Sequence[D.QAItem], ids: Sequence[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for it, i in zip(items, ids, strict=True):
            f.write(json.dumps(to_record(it, i)) + "\n")
