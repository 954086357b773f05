"""Tests for the zoo's synthetic QA generator, scoring and word-level tokenizer."""

from __future__ import annotations

import json

import pytest

from mdm_lens.zoo import data as d
from mdm_lens.zoo import tokenizer as T


def _words(text: str) -> set[str]:
    return set(text.split())


# ------------------------------------------------------------------------------ data


@pytest.mark.parametrize("fixed_world", [False, True])
def test_deterministic_under_seed(fixed_world: bool) -> None:
    a = d.make_dataset(20, seed=3, fixed_world=fixed_world)
    b = d.make_dataset(20, seed=3, fixed_world=fixed_world)
    c = d.make_dataset(20, seed=4, fixed_world=fixed_world)
    assert a == b
    assert [x.prompt for x in a] != [x.prompt for x in c]
    assert d.make_dataset(5, seed=3, fixed_world=fixed_world) == a[:5]  # prefix-stable
    assert d.training_texts(30, seed=1) == d.training_texts(30, seed=1)


@pytest.mark.parametrize("fixed_world", [False, True])
@pytest.mark.parametrize("k", [0, 1, 4, 8, 19])
def test_exactly_one_passage_contains_answer(k: int, fixed_world: bool) -> None:
    for it in d.make_dataset(40, seed=k, n_distractors=k, fixed_world=fixed_world):
        assert len(it.passages) == k + 1 and it.n_distractors == k
        holders = [i for i, p in enumerate(it.passages) if it.answer in _words(p)]
        assert holders == [it.gold_index]
        assert len(it.answer.split()) == 1
        # No two passages fill the same (relation, subject) slot: no contradictions.
        assert len(set(it.passages)) == len(it.passages)


def test_gold_position_honoured() -> None:
    cases = {"first": 0, "middle": 3, "last": 6, 2: 2, -1: 6}
    for pos, expected in cases.items():
        for it in d.make_dataset(10, seed=0, n_distractors=6, gold_position=pos):
            assert it.gold_index == expected
    seen = {it.gold_index for it in d.make_dataset(200, seed=0, n_distractors=4)}
    assert seen == set(range(5))  # "random" covers every slot
    with pytest.raises(ValueError):
        d.make_dataset(1, seed=0, n_distractors=2, gold_position=3)


def test_no_context_has_no_passages() -> None:
    for it in d.make_dataset(20, seed=0, no_context=True):
        assert it.passages == [] and it.passage_spans == [] and it.marker_spans == []
        assert it.gold_index is None and it.evidence_span is None
        assert it.prompt == f"<bos> question : {it.question} answer :"


def test_spans_map_back_to_substrings() -> None:
    for it in d.make_dataset(50, seed=5, n_distractors=6):
        p = it.prompt
        assert p.startswith("<bos> [1] ") and p.endswith(" " + it.answer_prefix)
        s, e = it.question_span
        assert p[s:e] == it.question
        for k, ((ps, pe), (ms, me)) in enumerate(zip(it.passage_spans, it.marker_spans)):
            assert p[ps:pe] == it.passages[k]
            assert p[ms:me] == f"[{k + 1}]" and me + 1 == ps
        s, e = it.evidence_span
        assert p[s:e] == it.answer
        gs, ge = it.passage_spans[it.gold_index]
        assert gs <= s < e <= ge
        assert d.training_text(it) == f"{p} {it.answer} <eos>"


def test_training_mixture_covers_eval_settings() -> None:
    items = d.training_items(400, seed=0)
    assert {it.n_distractors for it in items if it.passages} == set(range(9))
    assert any(it.gold_index is None for it in items)
    last = [it for it in items if it.passages and it.gold_index == len(it.passages) - 1]
    assert last


def test_fixed_world_is_consistent_and_random_mode_is_not_fixed() -> None:
    world = d.build_world(0)
    facts = {f.key: f.object for f in world.facts}
    assert len(facts) == len(world.facts)
    for country in d.COUNTRIES:  # each capital lies in its own country
        assert facts[("country", facts[("capital", country)])] == country
    items = d.make_dataset(300, seed=0, fixed_world=True, n_distractors=2)
    assert all(facts[(it.relation, it.subject)] == it.answer for it in items)
    rand = d.make_dataset(300, seed=0, n_distractors=0)
    answers: dict[tuple[str, str], set[str]] = {}
    for it in rand:
        answers.setdefault((it.relation, it.subject), set()).add(it.answer)
    assert any(len(v) > 1 for v in answers.values())  # same question, different answers


# --------------------------------------------------------------------------- scoring


def test_normalize_and_scores() -> None:
    assert d.normalize("  The  Kelmira, city!  ") == "kelmira city"
    assert d.normalize("kelmira <eos> <pad>") == "kelmira"
    assert d.exact_match("The kelmira.", "kelmira") == 1.0
    assert d.exact_match("kelmira city", "kelmira") == 0.0
    assert d.substring_match("it is kelmira city", "Kelmira") == 1.0
    assert d.substring_match("istravel", "istra") == 0.0  # word-aligned
    assert d.substring_match("vostheim", "kelmira") == 0.0
    assert d.token_f1("kelmira", "kelmira") == 1.0
    assert d.token_f1("kelmira city", "kelmira") == pytest.approx(2 / 3)
    assert d.token_f1("vostheim", "kelmira") == 0.0
    assert d.token_f1("", "") == 1.0 and d.token_f1("a", "kelmira") == 0.0
    items = d.make_dataset(4, seed=0)
    preds = [items[0].answer, f"{items[1].answer} city", "nope", ""]
    res = d.score(preds, items)
    assert res["exact_match"] == pytest.approx(0.25)
    assert res["substring_match"] == pytest.approx(0.5)
    assert res["f1"] == pytest.approx((1 + 2 / 3) / 4)
    assert res["n"] == 4
    with pytest.raises(ValueError):
        d.score(preds[:2], items)


# ------------------------------------------------------------------------- tokenizer


def test_special_token_ids_fixed() -> None:
    tok = T.load_tokenizer()
    for i, name in enumerate(["<pad>", "<bos>", "<eos>", "<mask>", "<unk>"]):
        assert tok.token_to_id(name) == i
    assert (T.PAD_ID, T.BOS_ID, T.EOS_ID, T.MASK_ID, T.UNK_ID) == (0, 1, 2, 3, 4)
    assert T.vocab_size() == len(d.vocabulary_words()) + 5 <= 600


def test_shipped_tokenizer_matches_rebuild() -> None:
    shipped = json.loads(T.TOKENIZER_PATH.read_text())
    rebuilt = json.loads(T.build_tokenizer().to_str())
    assert shipped["model"]["vocab"] == rebuilt["model"]["vocab"]
    assert T.TOKENIZER_PATH.stat().st_size < 300_000


def test_roundtrip_no_unk() -> None:
    items = d.training_items(300, seed=11) + d.make_dataset(20, 2, n_distractors=19)
    items += d.make_dataset(50, seed=2, fixed_world=True, n_distractors=8)
    for it in items:
        text = d.training_text(it)
        ids = T.encode(text)
        assert T.UNK_ID not in ids
        assert T.decode(ids) == text
        assert ids[0] == T.BOS_ID and ids[-1] == T.EOS_ID
    for k, limit in [(0, 24), (4, 64), (8, 120)]:
        lengths = [len(T.encode(it.prompt)) for it in d.make_dataset(100, 0, n_distractors=k)]
        assert max(lengths) <= limit


def test_decode_shows_mask_and_drops_pad() -> None:
    ids = T.encode("<bos> where was zorvan born ? answer :") + [T.MASK_ID, T.PAD_ID]
    assert T.decode(ids) == "<bos> where was zorvan born ? answer : <mask>"
    assert T.decode([T.PAD_ID], skip_pad=False) == "<pad>"
    assert T.encode("Kelmira.") == T.encode("kelmira .")  # robust to untidy text


def test_char_to_token_span_hits_answer_token() -> None:
    tok = T.load_tokenizer()
    for it in d.make_dataset(50, seed=9, n_distractors=8):
        ids, offsets = T.encode_with_offsets(it.prompt)
        assert len(ids) == len(offsets)
        s, e = T.char_span_to_token_span(offsets, it.evidence_span)
        assert e - s == 1 and ids[s] == tok.token_to_id(it.answer)
        qs, qe = T.char_span_to_token_span(offsets, it.question_span)
        assert T.decode(ids[qs:qe]) == it.question
        for k, span in enumerate(it.passage_spans):
            ps, pe = T.char_span_to_token_span(offsets, span)
            assert T.decode(ids[ps:pe]) == it.passages[k]
            assert ids[ps - 1] == tok.token_to_id(f"[{k + 1}]")
    with pytest.raises(ValueError):
        T.char_span_to_token_span([(0, 3), (4, 7)], (3, 4))
