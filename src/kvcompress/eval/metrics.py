"""Scoring: the official-style metrics of RULER, LongBench and SQuAD, each in [0, 1].

Every metric is ``fn(prediction, answers) -> float``: ``prediction`` is the model's answer
text, ``answers`` the reference answers (at least one). :func:`score` dispatches by name;
the names are :data:`METRICS`, the same as a task file's ``metric`` field (DESIGN.md,
"Task files").

=========  ===============================================================  ============
name       what it measures                                                  follows
=========  ===============================================================  ============
contains   fraction of the references found in the prediction (case-blind)   RULER
exact      normalized exact match, best over references                     SQuAD/LongBench
f1         normalized bag-of-tokens F1, best over references                SQuAD/LongBench
rouge_l    ROUGE-L F-measure (longest common subsequence), best over refs   LongBench
accuracy   first non-empty line equals / starts with a reference label      LongBench (classification)
=========  ===============================================================  ============
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

METRICS: tuple[str, ...] = ("contains", "exact", "f1", "rouge_l", "accuracy")

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NON_WORD = re.compile(r"[^\w]+")


def normalize_answer(text: str) -> str:
    """SQuAD's ``normalize_answer`` (also LongBench's): lower case, drop punctuation, the
    articles a/an/the, and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _check(answers: Sequence[str]) -> None:
    if isinstance(answers, str):
        raise TypeError("answers must be a list of strings, not a single string (wrap it: [answer]).")
    if len(answers) == 0:
        raise ValueError("answers is empty: give at least one reference answer.")


def contains(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of the reference answers that occur in the
    prediction, case-insensitively. A task whose answer has several parts (all values of a
    key, all variables of a chain) lists each part as one reference, so full marks need every
    part."""
    _check(answers)
    pred = prediction.lower()
    return sum(1.0 for ref in answers if ref.lower() in pred) / len(answers)


def exact(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD / LongBench exact match: 1 if the normalized prediction equals a normalized
    reference (:func:`normalize_answer`), else 0."""
    _check(answers)
    pred = normalize_answer(prediction)
    return max(float(pred == normalize_answer(ref)) for ref in answers)


def _f1_tokens(pred: list[str], ref: list[str]) -> float:
    if not pred or not ref:  # SQuAD v2: an empty side scores 1 only when both are empty
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD / LongBench ``qa_f1_score``: F1 of the bags of tokens of the normalized prediction
    and reference (:func:`normalize_answer`, split on whitespace), best over references."""
    _check(answers)
    pred = normalize_answer(prediction).split()
    return max(_f1_tokens(pred, normalize_answer(ref).split()) for ref in answers)


def _rouge_tokens(text: str) -> list[str]:
    # rouge-score's default tokenizer: lower case, non-word characters become separators.
    return _NON_WORD.sub(" ", text.lower()).split()


def _lcs_length(a: list[str], b: list[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-L F-measure (Lin 2004; LongBench's ``rouge_score`` for summarization): with
    ``L`` the longest common subsequence of the lower-cased word tokens, precision
    ``L / len(prediction)``, recall ``L / len(reference)``, F = 2PR / (P + R); best over
    references. Tokens are runs of word characters (punctuation separates, as in
    rouge-score's tokenizer)."""
    _check(answers)
    pred = _rouge_tokens(prediction)
    best = 0.0
    for ref in answers:
        tokens = _rouge_tokens(ref)
        if not pred or not tokens:
            best = max(best, float(pred == tokens))
            continue
        lcs = _lcs_length(pred, tokens)
        if lcs:
            precision, recall = lcs / len(pred), lcs / len(tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def accuracy(prediction: str, answers: Sequence[str]) -> float:
    """Classification accuracy (LongBench's few-shot classification tasks answer with a label
    on the first line): 1 if the normalized first non-empty line of the prediction equals a
    normalized reference label or starts with it followed by a word boundary (``"Positive.
    The review..."`` matches ``positive``; ``"positively"`` does not), else 0."""
    _check(answers)
    line = next((normalize_answer(row) for row in prediction.splitlines() if normalize_answer(row)), "")
    for ref in answers:
        label = normalize_answer(ref)
        if label and (line == label or line.startswith(label + " ")):
            return 1.0
    return 0.0


_FUNCTIONS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "contains": contains,
    "exact": exact,
    "f1": f1,
    "rouge_l": rouge_l,
    "accuracy": accuracy,
}


def get_metric(name: str) -> Callable[[str, Sequence[str]], float]:
    """The metric function called ``name``; ValueError naming the known ones otherwise."""
    try:
        return _FUNCTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(METRICS)}.") from None


def score(prediction: str, answers: Sequence[str], metric: str) -> float:
    """Score ``prediction`` against ``answers`` with the metric named ``metric`` (in [0, 1])."""
    return get_metric(metric)(prediction, answers)
