"""Built-in task generators and the task-file loader."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvcompress.demo import haystack_text
from kvcompress.eval.metrics import METRICS
from kvcompress.eval.tasks import BUILTIN_TASKS, MAX_NEW_TOKENS, Sample, load_task_file, make_task
from kvcompress.models import embedded_checkpoint

HAYSTACK_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")


@pytest.fixture(scope="module")
def words():
    """A tokenizer counting words and punctuation marks: fast, and enough to size contexts."""
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The embedded model's tokenizer only (converts the model on first use, ~30 s, hence slow)."""
    return AutoTokenizer.from_pretrained(embedded_checkpoint())


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_haystack_filler_has_no_digits():
    assert not re.search(r"\d", haystack_text())


def test_every_builtin_task_has_an_answer_length():
    assert set(MAX_NEW_TOKENS) == set(BUILTIN_TASKS)


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_same_seed_same_samples_other_seed_other_samples(words, name):
    first = make_task(name, words, 3, 400, seed=1)
    assert first == make_task(name, words, 3, 400, seed=1)
    assert make_task(name, words, 2, 400, seed=1) == first[:2]  # sample i does not depend on the count
    other = make_task(name, words, 3, 400, seed=2)
    assert all(a.context != b.context and a.answers != b.answers for a, b in zip(first, other, strict=True))
    assert len({s.context for s in first}) == 3  # samples differ from each other
    assert len({s.id for s in first}) == 3
    for sample in first:
        assert isinstance(sample, Sample) and sample.task == name and sample.metric in METRICS
        assert sample.question and sample.answers and sample.question not in sample.context


@pytest.mark.parametrize("name", BUILTIN_TASKS)
@pytest.mark.parametrize("size", [300, 1500, 6000])
def test_context_length_is_within_ten_percent(words, name, size):
    for sample in make_task(name, words, 2, size, seed=0):
        assert abs(n_tokens(words, sample.context) - size) <= 0.1 * size


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_context_length_in_smollm_tokens(smollm_tokenizer, name):
    for size in (1024, 1536):
        for sample in make_task(name, smollm_tokenizer, 3, size, seed=0):
            assert abs(n_tokens(smollm_tokenizer, sample.context) - size) <= 0.1 * size


@pytest.mark.parametrize("name", HAYSTACK_TASKS)
def test_needles_are_in_the_context_and_only_there(words, name):
    for sample in make_task(name, words, 4, 800, seed=0):
        for answer in sample.answers:
            assert answer in sample.context
        numbers = set(re.findall(r"\d+", sample.context))
        if name == "vt":
            (value,) = numbers  # the only number is the chain's value, asked about in the question
            assert value in sample.question
            assert set(re.findall(r"The variable ([A-Z]{5}) is set to", sample.context)) == set(sample.answers)
        else:
            assert set(sample.answers) <= numbers
            assert not any(answer in sample.question for answer in sample.answers)
        if name == "niah_multikey":
            assert len(numbers) > 1  # distractors: other keys' numbers


def test_niah_single_depths_spread_over_the_context(words):
    depths = []
    for sample in make_task("niah_single", words, 10, 1000, seed=0):
        depths.append(sample.context.index(sample.answers[0]) / len(sample.context))
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_cwe_answers_are_the_most_frequent_words(words):
    for sample in make_task("cwe", words, 3, 1200, seed=0):
        counts = Counter(re.findall(r"^\d+\. (\S+)$", sample.context, flags=re.M))
        top = [word for word, _ in counts.most_common(len(sample.answers))]
        assert sorted(top) == sorted(sample.answers)
        rest = max(c for w, c in counts.items() if w not in sample.answers)
        assert min(counts[w] for w in sample.answers) >= 3 * rest
        assert str(len(sample.answers)) in sample.question
        # no answer hides inside another word of the list (the metric matches substrings)
        assert not any(a in w for a in sample.answers for w in counts if w != a)


def test_make_task_refuses_bad_requests(words):
    with pytest.raises(ValueError, match="unknown task 'niah'.*niah_single"):
        make_task("niah", words, 1, 500, seed=0)
    with pytest.raises(ValueError, match="too small"):
        make_task("niah_multivalue", words, 1, 40, seed=0)
    assert make_task("vt", words, 0, 500, seed=0) == []


# --------------------------------------------------------------------------- task files

ROW = {"id": "a1", "context": "Paris is in France.", "question": "Where is Paris?", "answers": ["France"],
       "task": "geo", "metric": "contains"}  # fmt: skip


def write(tmp_path, rows) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_load_task_file_reads_rows_and_skips_blank_lines(tmp_path):
    path = write(tmp_path, [ROW, "", "   ", {**ROW, "id": 7, "metric": "f1", "extra": 1}])
    samples = load_task_file(path)
    assert samples == [
        Sample("a1", "Paris is in France.", "Where is Paris?", ["France"], "geo", "contains"),
        Sample("7", "Paris is in France.", "Where is Paris?", ["France"], "geo", "f1"),
    ]


def test_load_task_file_round_trips_generated_samples(tmp_path, words):
    samples = make_task("niah_single", words, 2, 300, seed=0)
    path = write(tmp_path, [s.to_dict() for s in samples])
    assert load_task_file(path) == samples


def test_load_task_file_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_task_file(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"metric": "bleu"}, r"line 2: unknown metric 'bleu'.*contains, exact"),
        ({"answers": []}, r"line 2: field 'answers' is empty"),
        ({"answers": [1]}, r"line 2: field 'answers' must be a list of strings"),
        ({"context": "  "}, r"line 2: field 'context' is empty"),
        ({"question": None}, r"line 2: field 'question' must be a string"),
        ({"id": "a1"}, r"line 2: duplicate id 'a1'.*first on line 1"),
    ],
)
def test_load_task_file_names_line_and_field(tmp_path, bad, message):
    path = write(tmp_path, [ROW, {**ROW, "id": "b2", **bad}])
    with pytest.raises(ValueError, match=message):
        load_task_file(path)


def test_load_task_file_missing_field_and_bad_json(tmp_path):
    row = {k: v for k, v in ROW.items() if k != "answers"}
    with pytest.raises(ValueError, match=r"line 1: missing field answers"):
        load_task_file(write(tmp_path, [row]))
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        load_task_file(write(tmp_path, [ROW, "{not json"]))
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object"):
        load_task_file(write(tmp_path, ["[1, 2]"]))
    with pytest.raises(ValueError, match="no samples"):
        load_task_file(write(tmp_path, [""]))
