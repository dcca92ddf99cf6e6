"""The metrics against hand-computed values."""

from __future__ import annotations

import pytest

from kvcompress.eval.metrics import (
    METRICS,
    accuracy,
    contains,
    exact,
    f1,
    get_metric,
    normalize_answer,
    rouge_l,
    score,
)


def test_normalize_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The Cat, an  owl & A dog!  ") == "cat owl dog"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("...") == ""


def test_contains_is_the_fraction_of_references_found_case_blind():
    assert contains("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert contains("VAR abcde, VAR FGHIJ", ["ABCDE", "fghij"]) == 1.0
    assert contains("nothing here", ["42"]) == 0.0


def test_exact_matches_after_normalization_best_over_answers():
    assert exact("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert exact("Eiffel Tower in Paris", ["eiffel tower"]) == 0.0
    assert exact("Paris", ["London", "paris!"]) == 1.0


def test_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]
    # common = 2, precision = 2/2 = 1, recall = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert f1("the cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    # best over answers: the second reference matches exactly
    assert f1("the cat sat", ["a dog", "cat sat"]) == 1.0
    # repeated tokens count with multiplicity: [cat, cat] vs [cat]: common 1, P = 1/2, R = 1, F1 = 2/3
    assert f1("cat cat", ["cat"]) == pytest.approx(2 / 3)
    assert f1("dog", ["cat"]) == 0.0
    assert f1("", ["cat"]) == 0.0
    assert f1("the", ["a"]) == 1.0  # both empty after normalization (SQuAD v2)


def test_rouge_l_by_hand():
    # pred [the, cat, sat, on, the, mat] vs ref [the, cat, lay, on, the, red, mat]
    # LCS = the cat on the mat = 5; P = 5/6, R = 5/7, F = 2PR/(P+R) = 50/65 = 10/13
    assert rouge_l("The cat sat on the mat.", ["the cat lay on the red mat"]) == pytest.approx(10 / 13)
    # order matters (unlike f1): LCS of [a, b, c] and [c, b, a] is 1; P = R = 1/3
    assert rouge_l("a b c", ["c b a"]) == pytest.approx(1 / 3)
    assert rouge_l("a b c", ["x y", "a b c"]) == 1.0
    assert rouge_l("", ["a"]) == 0.0


def test_accuracy_reads_the_first_non_empty_line():
    assert accuracy("\n  Positive.\nBecause the review is kind.", ["positive"]) == 1.0
    assert accuracy("Positive review, clearly", ["positive"]) == 1.0  # starts with the label
    assert accuracy("Positively glowing", ["positive"]) == 0.0  # not at a word boundary
    assert accuracy("The answer:\npositive", ["positive"]) == 0.0  # only the first line counts
    assert accuracy("Negative, not positive", ["positive"]) == 0.0
    assert accuracy("", ["positive"]) == 0.0
    assert accuracy("Location", ["Human", "location"]) == 1.0


def test_score_dispatches_by_name_and_rejects_unknown_metrics():
    assert set(METRICS) == {"contains", "exact", "f1", "rouge_l", "accuracy"}
    for name in METRICS:
        assert get_metric(name)("cat", ["cat"]) == 1.0
        assert 0.0 <= score("the cat sat", ["a cat sat down"], name) <= 1.0
    assert score("the cat sat", ["a cat sat down"], "f1") == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'.*contains, exact, f1, rouge_l, accuracy"):
        score("x", ["x"], "bleu")


def test_metrics_need_a_list_of_answers():
    with pytest.raises(ValueError, match="answers is empty"):
        contains("x", [])
    with pytest.raises(TypeError, match="list of strings"):
        f1("x", "x")  # type: ignore[arg-type]
