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

The code lives in `pools` (words, relations, types), `sampling` (worlds, items, datasets) and `scoring`;
this module re-exports all of it, so `from mdm_lens.zoo import data` keeps working.
"""

from __future__ import annotations

from mdm_lens.zoo.pools import (  # noqa: F401
    ANSWER_PREFIX, BOS, CITIES, COLOURS, COMPANIES, COUNTRIES, EOS, Fact, GoldPosition, INSTRUMENTS,
    MAX_PASSAGES, passage_marker, PERSONS, PETS, POOLS, QAItem, QUESTION_CUE, Relation, RELATION_NAMES,
    RELATIONS, vocabulary_words, YEARS)
from mdm_lens.zoo.sampling import (  # noqa: F401
    _random_fact, _resolve_gold_index, _sample_distractors, _slots, build_item, build_world, make_dataset,
    render_passage, sample_item, training_items, training_text, training_texts, World)
from mdm_lens.zoo.scoring import (  # noqa: F401
    _ARTICLES_RE, _PUNCT_TABLE, _SPECIAL_RE, exact_match, normalize, score, substring_match, token_f1)
