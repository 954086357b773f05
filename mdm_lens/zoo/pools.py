"""Zoo data, part 1: the fixed word pools (the shipped tokenizer is built from exactly these words), the
relations with their passage and question templates, and the `Fact` / `QAItem` types."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from mdm_lens.items import ANSWER_PREFIX, BOS, EOS, QAItem, QUESTION_CUE, passage_marker  # noqa: F401  (re-exported: the core owns the item type)

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


GoldPosition = int | Literal["random", "first", "middle", "last"]

# --------------------------------------------------------------------------------------
# Vocabulary (consumed by the tokenizer builder)
# --------------------------------------------------------------------------------------


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
