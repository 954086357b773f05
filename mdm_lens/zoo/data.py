"""Synthetic knowledge-QA data for the tiny model zoo (RAG-style, fully fictional).

Why synthetic: the zoo's twin models (a masked diffusion LM and an autoregressive LM)
are ~1-4M-parameter transformers trained on CPU in minutes, so the task must be
learnable at that scale, have a small closed vocabulary (one word = one token), and
let us *control* the evidence: how many distractor passages there are, where the gold
passage sits, and whether any context is given at all.

World and facts
---------------
Entities are generated-looking fictional names from fixed pools (people, cities,
companies, countries) plus small pools of ordinary attribute words (colours, pets,
instruments, years). A fact is ``(relation, subject, object)``; each relation has two
short passage templates and one question template (see ``RELATIONS``).

* ``fixed_world=False`` (default): facts are sampled *fresh per item* from the pools, so
  nothing can be memorised and the answer is only recoverable by reading the gold
  passage. Closed-book accuracy is at chance; the gain from evidence is large.
* ``fixed_world=True``: facts come from one consistent seeded world (``build_world``),
  so a model trained on it can answer closed-book above chance.

Distractors are facts about other subjects and/or other relations (about half share the
question's relation -- "hard negatives" that force subject matching). They never contain
the answer word and never contradict or duplicate the asked fact (checked, resampled).

Prompt format (lower-case, every token separated by one space)
--------------------------------------------------------------
::

    <bos> [1] {passage 1} [2] {passage 2} ... question : {question} answer :

The no-context variant is ``<bos> question : {question} answer :``. Models are trained on
``training_text(item) == prompt + " " + answer + " <eos>"``. Example,
``make_dataset(1, seed=0, n_distractors=2, gold_position=1)[0]``::

    <bos> [1] cadrel works for ravlex . [2] garvin was born in the city of lunmarsh .
    [3] lisvet was born in wexhollow . question : where was garvin born ? answer :
                                                        -> answer "lunmarsh"

``QAItem`` carries character spans into ``prompt`` for the question, each passage (the
sentence without its ``[k]`` marker), each marker, and the answer occurrence inside the
gold passage (``evidence_span``); ``mdm_lens.zoo.tokenizer.char_span_to_token_span`` maps
them to token positions of one tokenisation.

Scoring (``normalize``, ``exact_match``, ``substring_match``, ``token_f1``, ``score``)
follows SQuAD conventions so numbers are comparable with the usual RAG-QA literature.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

# --------------------------------------------------------------------------------------
# Pools (fixed literals: the shipped tokenizer is built from exactly these words).
# --------------------------------------------------------------------------------------

PERSONS: tuple[str, ...] = (
    "zorvan", "kalder", "dravin", "talos", "morwen", "sefira", "thalen", "quorin",
    "velka", "brisa", "fendar", "ilvar", "corvel", "naxil", "pelora", "ruvik",
    "sorin", "tamsel", "ulfra", "varek", "wendral", "yorra", "zeltra", "akren",
    "belvo", "cirin", "dorvak", "elsira", "faelor", "garvin", "halvri", "istra",
    "jorvel", "kastra", "lunder", "mavrik", "nerith", "orvane", "pasko", "quella",
    "rendis", "saevar", "torvik", "usrel", "vantha", "wilmar", "xandor", "yselle",
    "zimra", "brannok", "cadrel", "dulsa", "evrin", "fiskel", "gorla", "heddrin",
    "jaskar", "korrin", "lisvet", "marnok",
)  # fmt: skip

CITIES: tuple[str, ...] = (
    "kelmira", "vostheim", "brakmoor", "tirandel", "ulmeport", "sarnhold", "quendor",
    "mirathis", "feldrun", "orsanne", "hollivar", "pentavik", "zarnholm", "elvasta",
    "dunmarrow", "ketterby", "lorvanth", "nimbrel", "ostrevin", "caldmere",
    "wexhollow", "frostal", "yarrowin", "rivenna", "toldach", "amberlin", "skarrow",
    "vellmoor", "glimmhold", "drosselt", "marrowick", "belquist", "farnhollow",
    "istravel", "jorheim", "kaldris", "lunmarsh", "morvath", "nessaby", "ombrel",
    "pallenta", "quarvik", "rostenmoor", "sildra", "tavernis", "umbrith", "varnholt",
    "wistmere", "zellmark", "yorvinde",
)  # fmt: skip

COMPANIES: tuple[str, ...] = (
    "drelko", "vantix", "zorbatek", "quillsoft", "nexora", "brimcorp", "kolvex",
    "tarnwell", "fluxano", "grivo", "helmstad", "ivarro", "jexlo", "kryntek",
    "lumora", "mavrex", "nolvo", "orbalis", "pyxen", "quorra", "ravlex", "stenvo",
    "trimbix", "ulvent", "voxaro", "wrenlo", "xelcor", "yantrix", "zentiq", "blorvex",
)  # fmt: skip

COUNTRIES: tuple[str, ...] = (
    "vostra", "elandia", "drakmor", "quessaly", "ostravia", "tarnland", "belvoria",
    "kestrania", "lumeria", "morvany", "norvekia", "palundra", "rhovenia", "sarkesh",
    "thyrmark", "ulvaria", "veskandor", "wyrland", "zandoria", "cyrelia",
)  # fmt: skip

COLOURS: tuple[str, ...] = (
    "red", "blue", "green", "yellow", "purple", "orange",
    "white", "black", "grey", "pink", "teal", "brown",
)  # fmt: skip

PETS: tuple[str, ...] = (
    "cat", "dog", "otter", "parrot", "rabbit", "turtle",
    "hamster", "ferret", "goat", "lizard", "owl", "pony",
)  # fmt: skip

INSTRUMENTS: tuple[str, ...] = (
    "harp", "flute", "violin", "drum", "piano",
    "cello", "guitar", "trumpet", "banjo", "oboe",
)  # fmt: skip

YEARS: tuple[str, ...] = tuple(str(y) for y in range(1950, 2000))

POOLS: dict[str, tuple[str, ...]] = {
    "person": PERSONS,
    "city": CITIES,
    "company": COMPANIES,
    "country": COUNTRIES,
    "colour": COLOURS,
    "pet": PETS,
    "instrument": INSTRUMENTS,
    "year": YEARS,
}

#: Most passages the format supports (gold + up to 19 distractors); one marker token each.
MAX_PASSAGES = 20
BOS, EOS = "<bos>", "<eos>"
QUESTION_CUE = "question :"
#: The text the answer follows at the very end of every prompt.
ANSWER_PREFIX = "answer :"


@dataclass(frozen=True)
class Relation:
    """A relation type: subject/object pools, two passage templates and a question.

    Two templates per relation add a little surface variety so models learn to read
    rather than pattern-match one sentence shape. Templates use ``{s}``/``{o}``.
    """

    name: str
    subject: str
    object: str
    templates: tuple[str, str]
    question: str


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation("born_in", "person", "city",
                 ("{s} was born in {o} .", "{s} was born in the city of {o} ."),
                 "where was {s} born ?"),
        Relation("lives_in", "person", "city",
                 ("{s} lives in {o} .", "{s} now lives in the city of {o} ."),
                 "where does {s} live ?"),
        Relation("works_for", "person", "company",
                 ("{s} works for {o} .", "{s} is employed by {o} ."),
                 "which company does {s} work for ?"),
        Relation("colour", "person", "colour",
                 ("the favourite colour of {s} is {o} .", "{s} likes the colour {o} best ."),
                 "what is the favourite colour of {s} ?"),
        Relation("pet", "person", "pet",
                 ("{s} owns a pet {o} .", "{s} has a {o} as a pet ."),
                 "what pet does {s} own ?"),
        Relation("instrument", "person", "instrument",
                 ("{s} plays the {o} .", "{s} can play the {o} well ."),
                 "which instrument does {s} play ?"),
        Relation("country", "city", "country",
                 ("{s} is a city in {o} .", "the city of {s} lies in {o} ."),
                 "in which country is {s} ?"),
        Relation("city_founded", "city", "year",
                 ("{s} was founded in {o} .", "the city of {s} was built in {o} ."),
                 "when was {s} founded ?"),
        Relation("capital", "country", "city",
                 ("the capital of {s} is {o} .", "{o} is the capital city of {s} ."),
                 "what is the capital of {s} ?"),
        Relation("company_founded", "company", "year",
                 ("the company {s} was founded in {o} .", "{s} was started in the year {o} ."),
                 "in which year was {s} founded ?"),
        Relation("founder", "company", "person",
                 ("{s} was founded by {o} .", "the founder of {s} is {o} ."),
                 "who founded {s} ?"),
        Relation("headquarters", "company", "city",
                 ("{s} has its headquarters in {o} .", "the company {s} is based in {o} ."),
                 "where is {s} based ?"),
    )
}  # fmt: skip
RELATION_NAMES: tuple[str, ...] = tuple(RELATIONS)


@dataclass(frozen=True)
class Fact:
    """One ``(relation, subject, object)`` triple."""

    relation: str
    subject: str
    object: str

    @property
    def key(self) -> tuple[str, str]:
        """The (relation, subject) slot this fact fills; one object per slot."""
        return (self.relation, self.subject)


@dataclass
class QAItem:
    """One QA example plus everything analysis code needs to locate prompt regions.

    All spans are half-open character offsets into ``prompt`` (``prompt[s:e]``).
    ``passages[i]`` is the i-th passage sentence without its ``[i+1]`` marker, and
    ``prompt[passage_spans[i][0]:passage_spans[i][1]] == passages[i]``.
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

    @property
    def n_distractors(self) -> int:
        """Number of non-gold passages (0 for no-context items)."""
        return max(len(self.passages) - 1, 0)


GoldPosition = int | Literal["random", "first", "middle", "last"]

# --------------------------------------------------------------------------------------
# Vocabulary (consumed by the tokenizer builder)
# --------------------------------------------------------------------------------------


def passage_marker(k: int) -> str:
    """Marker for the k-th passage (1-based), a single token such as ``[3]``."""
    return f"[{k}]"


def vocabulary_words() -> list[str]:
    """Every word the generator can emit (no special tokens), in a stable order.

    The tokenizer is built from this list, so generated text never hits ``<unk>``.
    """
    words: list[str] = [passage_marker(k) for k in range(1, MAX_PASSAGES + 1)]
    template_text = [QUESTION_CUE, ANSWER_PREFIX]
    for rel in RELATIONS.values():
        template_text.extend(rel.templates)
        template_text.append(rel.question)
    for text in template_text:
        for w in text.replace("{s}", " ").replace("{o}", " ").split():
            words.append(w)
    for pool in POOLS.values():
        words.extend(pool)
    return list(dict.fromkeys(words))  # dedupe, keep first occurrence order


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
