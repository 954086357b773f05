"""Zoo twins, part 2: the training data stream (one padded batch of prompt + answer canvas per step, with a
distractor curriculum)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as T
from mdm_lens.zoo.recipe import TrainConfig

@dataclass
class Batch:
    ids: torch.Tensor  # [batch, width] clean tokens, right-padded with <pad>
    attention_mask: torch.Tensor  # [batch, width] 1 = real
    starts: torch.Tensor  # [batch] index of the first canvas slot (= prompt length)
    lengths: torch.Tensor  # [batch] real length (prompt + G)


def encode_training_item(item: D.QAItem, gen_length: int) -> tuple[list[int], int]:
    """``prompt + [answer, <eos> × (G-1)]`` and the prompt length."""
    prompt = T.encode(item.prompt)
    answer = T.encode(item.answer)
    if len(answer) > gen_length - 1:
        raise ValueError(f"answer {item.answer!r} needs {len(answer)} tokens; gen_length={gen_length} is too short.")
    canvas = answer + [T.EOS_ID] * (gen_length - len(answer))
    return prompt + canvas, len(prompt)


def collate(rows: list[tuple[list[int], int]]) -> Batch:
    width = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), width), T.PAD_ID, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (r, _) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        am[i, : len(r)] = 1
    return Batch(ids, am, torch.tensor([s for _, s in rows]), am.sum(1))


def max_distractors_at(progress: float, tc: TrainConfig) -> int:
    """The curriculum: the largest distractor count drawn at training progress ``progress`` in [0, 1]."""
    if tc.curriculum <= 0:
        return tc.max_distractors
    return min(tc.max_distractors, int(tc.max_distractors * progress / tc.curriculum + 1e-9))


def batch_stream(tc: TrainConfig, progress=lambda: 1.0):
    """Deterministic, infinite stream of batches: chunks of ``bucket`` batches of fresh items,
    length-sorted, cut into batches, batch order shuffled. Depends only on the data settings and on
    the curriculum's ``max_distractors_at(progress())``, read once per chunk."""
    chunk = 0
    n = tc.batch_size * tc.bucket
    while True:
        k = max_distractors_at(progress(), tc)
        items = D.training_items(n, seed=tc.data_seed * 1_000_003 + chunk, max_distractors=k,
                                 no_context_frac=tc.no_context_frac, hard_negative_frac=tc.hard_negative_frac)
        rows = sorted((encode_training_item(it, tc.gen_length) for it in items), key=lambda r: len(r[0]))
        batches = [rows[i : i + tc.batch_size] for i in range(0, n, tc.batch_size)]
        random.Random(f"mdm_lens.zoo.batches:{tc.data_seed}:{chunk}").shuffle(batches)
        for b in batches:
            yield collate(b)
        chunk += 1
