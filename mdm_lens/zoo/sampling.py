"""Zoo data, part 2: worlds, fact and distractor sampling, item rendering with character spans, datasets
and training texts."""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from mdm_lens.zoo.pools import (
    CITIES, COUNTRIES, POOLS, MAX_PASSAGES, BOS, EOS, QUESTION_CUE, ANSWER_PREFIX, RELATIONS,
    RELATION_NAMES, Fact, QAItem, GoldPosition, passage_marker)

# --------------------------------------------------------------------------------------
# Worlds and fact sampling
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """A fixed, internally consistent set of facts (one object per slot)."""

    facts: tuple[Fact, ...]
    _by_relation: dict[str, tuple[Fact, ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        index: dict[str, list[Fact]] = {r: [] for r in RELATION_NAMES}
        for f in self.facts:
            index[f.relation].append(f)
        object.__setattr__(self, "_by_relation", {r: tuple(v) for r, v in index.items()})

    def by_relation(self, relation: str) -> tuple[Fact, ...]:
        """All facts of one relation (used to draw same-relation hard negatives)."""
        return self._by_relation[relation]


@lru_cache(maxsize=8)
def build_world(world_seed: int = 0) -> World:
    """Build the fixed world: every subject gets one object for each of its relations.

    Consistency matters for closed-book learning: each city lies in exactly one
    country and each country's capital is one of its own cities.
    """
    rng = random.Random(f"mdm_lens.zoo.world:{world_seed}")
    city_country: dict[str, str] = {}
    cities = list(CITIES)
    rng.shuffle(cities)
    for i, city in enumerate(cities):  # first len(COUNTRIES) cities cover every country
        city_country[city] = COUNTRIES[i] if i < len(COUNTRIES) else rng.choice(COUNTRIES)
    facts: list[Fact] = []
    for rel in RELATIONS.values():
        for subj in POOLS[rel.subject]:
            if rel.name == "country":
                obj = city_country[subj]
            elif rel.name == "capital":
                obj = rng.choice(sorted(c for c, k in city_country.items() if k == subj))
            else:
                obj = rng.choice(POOLS[rel.object])
            facts.append(Fact(rel.name, subj, obj))
    return World(tuple(facts))


def _random_fact(rng: random.Random, relation: str | None = None) -> Fact:
    """A fresh fact with a random (or given) relation, subject and object."""
    rel = RELATIONS[relation or rng.choice(RELATION_NAMES)]
    return Fact(rel.name, rng.choice(POOLS[rel.subject]), rng.choice(POOLS[rel.object]))


def _slots(fact: Fact) -> set[tuple[str, str]]:
    """Slots a fact asserts, including implied ones ("capital of X is Y" => Y in X).

    Two facts sharing a slot would duplicate or contradict each other, so a context
    never contains two facts with overlapping slots.
    """
    slots = {fact.key}
    if fact.relation == "capital":
        slots.add(("country", fact.object))
    return slots


def render_passage(fact: Fact, template_id: int) -> tuple[str, tuple[int, int]]:
    """Render a fact; return the sentence and the char span of the object inside it."""
    template = RELATIONS[fact.relation].templates[template_id]
    head = template.split("{o}")[0].format(s=fact.subject)
    start = len(head)
    return template.format(s=fact.subject, o=fact.object), (start, start + len(fact.object))


def _sample_distractors(
    rng: random.Random,
    gold: Fact,
    n: int,
    world: World | None,
    hard_negative_frac: float,
    max_tries: int = 1000,
) -> list[Fact]:
    """Sample ``n`` distractor facts that neither contain nor contradict the answer."""
    used = set(_slots(gold))
    out: list[Fact] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > max_tries * max(n, 1):
            raise RuntimeError(f"could not sample {n} distractors for {gold}")
        same_rel = rng.random() < hard_negative_frac
        if world is None:
            cand = _random_fact(rng, gold.relation if same_rel else None)
        else:
            pool = world.by_relation(gold.relation) if same_rel else world.facts
            cand = rng.choice(pool)
        if gold.object in (cand.subject, cand.object) or _slots(cand) & used:
            continue
        used |= _slots(cand)
        out.append(cand)
    return out


def _resolve_gold_index(gold_position: GoldPosition, n_passages: int, rng: random.Random) -> int:
    """Turn ``gold_position`` ("random"/"first"/"middle"/"last"/int) into an index."""
    if gold_position == "random":
        return rng.randrange(n_passages)
    if gold_position == "first":
        return 0
    if gold_position == "middle":
        return n_passages // 2
    if gold_position == "last":
        return n_passages - 1
    if isinstance(gold_position, int) and -n_passages <= gold_position < n_passages:
        return gold_position % n_passages
    raise ValueError(f"gold_position {gold_position!r} invalid for {n_passages} passages")


# --------------------------------------------------------------------------------------
# Item construction
# --------------------------------------------------------------------------------------


def build_item(
    gold: Fact,
    distractors: Sequence[Fact],
    gold_index: int | None,
    template_ids: Sequence[int] | None = None,
) -> QAItem:
    """Render a QA item from explicit facts (``gold_index=None`` => no context).

    Exposed so analysis code can build counterfactual items (e.g. swap the gold fact)
    with exactly the same layout.
    """
    rel = RELATIONS[gold.relation]
    facts: list[Fact] = []
    if gold_index is not None:
        facts = list(distractors)
        facts.insert(gold_index, gold)
    if len(facts) > MAX_PASSAGES:
        raise ValueError(f"at most {MAX_PASSAGES} passages supported, got {len(facts)}")
    tids = list(template_ids) if template_ids is not None else [0] * len(facts)

    parts: list[str] = [BOS]
    pos = len(BOS)
    passages: list[str] = []
    passage_spans: list[tuple[int, int]] = []
    marker_spans: list[tuple[int, int]] = []
    evidence_span: tuple[int, int] | None = None

    def add(text: str) -> tuple[int, int]:
        nonlocal pos
        parts.append(" " + text)
        start = pos + 1
        pos = start + len(text)
        return (start, pos)

    for i, (fact, tid) in enumerate(zip(facts, tids, strict=True)):
        marker_spans.append(add(passage_marker(i + 1)))
        sentence, (o_s, o_e) = render_passage(fact, tid)
        span = add(sentence)
        passages.append(sentence)
        passage_spans.append(span)
        if i == gold_index:
            evidence_span = (span[0] + o_s, span[0] + o_e)
    add(QUESTION_CUE)
    question = rel.question.format(s=gold.subject)
    question_span = add(question)
    add(ANSWER_PREFIX)
    return QAItem(
        question=question,
        answer=gold.object,
        passages=passages,
        gold_index=gold_index,
        prompt="".join(parts),
        passage_spans=passage_spans,
        question_span=question_span,
        evidence_span=evidence_span,
        marker_spans=marker_spans,
        relation=gold.relation,
        subject=gold.subject,
    )


def sample_item(
    rng: random.Random,
    n_distractors: int = 4,
    gold_position: GoldPosition = "random",
    no_context: bool = False,
    world: World | None = None,
    hard_negative_frac: float = 0.5,
) -> QAItem:
    """Sample one item with the given RNG (the building block of ``make_dataset``)."""
    if not 0 <= n_distractors < MAX_PASSAGES:
        raise ValueError(f"n_distractors must be in 0..{MAX_PASSAGES - 1}")
    gold = _random_fact(rng) if world is None else rng.choice(world.facts)
    if no_context:
        return build_item(gold, [], None)
    distractors = _sample_distractors(rng, gold, n_distractors, world, hard_negative_frac)
    gold_index = _resolve_gold_index(gold_position, n_distractors + 1, rng)
    template_ids = [rng.randrange(2) for _ in range(n_distractors + 1)]
    return build_item(gold, distractors, gold_index, template_ids)


def make_dataset(
    n: int,
    seed: int,
    n_distractors: int = 4,
    gold_position: GoldPosition = "random",
    no_context: bool = False,
    fixed_world: bool = False,
    world_seed: int = 0,
    hard_negative_frac: float = 0.5,
) -> list[QAItem]:
    """Generate ``n`` items deterministically from ``seed``.

    ``world_seed`` only matters with ``fixed_world=True``; keep it equal between train
    and eval so they share a world while ``seed`` varies. Item ``i`` depends only on
    ``seed`` and the settings, not on ``n``.
    """
    rng = random.Random(f"mdm_lens.zoo.items:{seed}")
    world = build_world(world_seed) if fixed_world else None
    return [
        sample_item(rng, n_distractors, gold_position, no_context, world, hard_negative_frac)
        for _ in range(n)
    ]


def training_text(item: QAItem) -> str:
    """The training string for one item: ``prompt + " " + answer + " <eos>"``."""
    return f"{item.prompt} {item.answer} {EOS}"


def training_items(
    n: int,
    seed: int,
    max_distractors: int = 8,
    no_context_frac: float = 0.1,
    fixed_world: bool = False,
    world_seed: int = 0,
    hard_negative_frac: float = 0.5,
) -> list[QAItem]:
    """Training mixture: distractor counts uniform in 0..max_distractors, random gold
    position, and a ``no_context_frac`` share of no-context items.

    The mixture covers every evaluation setting (0/1/2/4/6/8 distractors, gold
    first/middle/last, closed-book) so eval prompts are in distribution.
    """
    rng = random.Random(f"mdm_lens.zoo.train:{seed}")
    world = build_world(world_seed) if fixed_world else None
    items: list[QAItem] = []
    for _ in range(n):
        no_ctx = rng.random() < no_context_frac
        k = rng.randint(0, max_distractors)
        items.append(sample_item(rng, k, "random", no_ctx, world, hard_negative_frac))
    return items


def training_texts(
    n: int,
    seed: int,
    max_distractors: int = 8,
    no_context_frac: float = 0.1,
    fixed_world: bool = False,
    world_seed: int = 0,
    hard_negative_frac: float = 0.5,
) -> list[str]:
    """``training_text`` of each item of ``training_items`` (same arguments)."""
    items = training_items(
        n, seed, max_distractors, no_context_frac, fixed_world, world_seed, hard_negative_frac
    )
    return [training_text(it) for it in items]
