"""The mutation catalogue stays applicable: every snippet occurs exactly once in its file (cheap; the mutation
run itself, `python -m tests.mutants`, takes minutes and is not part of CI)."""

from tests.mutants.__main__ import check_catalogue
from tests.mutants.catalogue import MUTANTS


def test_every_mutant_applies_exactly_once():
    assert check_catalogue() == []


def test_catalogue_covers_every_area():
    assert {m.area for m in MUTANTS} >= {"sampler", "model"}
