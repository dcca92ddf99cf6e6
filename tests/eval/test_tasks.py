"""Built-in task generators and the task-file loader."""

from __future__ import annotations

import hashlib
import json
import random
import re
import textwrap
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvcompress.demo import haystack_text
from kvcompress.eval import tasks
from kvcompress.eval.metrics import METRICS
from kvcompress.eval.tasks import BUILTIN_TASKS, MAX_NEW_TOKENS, Sample, load_haystack, load_task_file, make_task
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


# The samples of the built-in prose, pinned: a change to generation (or to the prose) shows here.
DEFAULT_DIGESTS = {
    ("niah_single", 0, 500): "16a4e5c083eab44b", ("niah_single", 3, 1500): "5cb4892302222aa2",
    ("niah_multikey", 0, 500): "810a2207b3f42c8d", ("niah_multikey", 3, 1500): "069edf0759559df0",
    ("niah_multivalue", 0, 500): "b714be00212cac8a", ("niah_multivalue", 3, 1500): "601e22abc2a5f2d4",
    ("vt", 0, 500): "98636ee7f012bb64", ("vt", 3, 1500): "c1c92bf5fbea750d",
    ("cwe", 0, 500): "5f7006c373e044fb", ("cwe", 3, 1500): "7cdb3b69f0c955a8",
}  # fmt: skip


def digest(samples: list[Sample]) -> str:
    return hashlib.sha256(json.dumps([s.to_dict() for s in samples], sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("name", "seed", "size"), sorted(DEFAULT_DIGESTS))
def test_default_samples_are_unchanged(words, name, seed, size):
    samples = make_task(name, words, 3, size, seed=seed)
    assert [s.id for s in samples] == [f"{name}-{seed}-{i}" for i in range(3)]
    assert digest(samples) == DEFAULT_DIGESTS[(name, seed, size)]
    assert make_task(name, words, 3, size, seed=seed, haystack=None) == samples


# --------------------------------------------------------------------------- another haystack

HAY_WORDS = (
    "anchor", "barley", "cinder", "dervish", "ember", "fjord", "garnet", "hollow", "inlet", "juniper", "kestrel",
    "lichen", "marrow", "nettle", "orchard", "pewter", "quarry", "russet", "sorrel", "thistle", "umber", "vellum",
    "willow", "yarrow", "zephyr", "bramble", "cobble", "drizzle", "fennel", "gravel", "heather", "ivory", "jasper",
    "kelpie", "lantern", "mizzen", "nutmeg", "oxbow", "plover", "quince", "rushes", "saffron", "tallow", "upland",
)  # fmt: skip
DOMINANT = ("harbor", "ledger")  # in every sentence: they dominate the file's words


def haystack_document(rng: random.Random, number: int) -> str:
    """A title, prose with years and counts, tables of long digit strings, code and capitals: like real text."""
    paragraphs = [f"LEDGER {number} ({1850 + 7 * number})"]
    for p in range(12):
        if p % 4 == 0:  # prose, wrapped like a book
            sentences = [f"In {rng.randrange(1700, 2030)} the {rng.choice(HAY_WORDS)} of the harbor ledger held "
                         f"{rng.randrange(2, 999)} {rng.choice(HAY_WORDS)} casks and {rng.choice(HAY_WORDS)}."
                         for _ in range(rng.randrange(3, 7))]
            paragraphs.append(textwrap.fill(" ".join(sentences), width=72))
        elif p % 4 == 1:  # a table of long numbers: many 5- and 7-digit strings inside them
            paragraphs.append("\n".join("  " + " ".join("".join(rng.choices("0123456789", k=300)) for _ in range(3))
                                         for _ in range(25)))
        elif p % 4 == 2:  # code with its comments
            paragraphs.append(f"    total = {rng.randrange(10, 99999)} * {rng.randrange(2, 60)}  # harbor ledger\n"
                              f"    {rng.choice(HAY_WORDS)} = total // {rng.randrange(2, 9)}.{rng.randrange(10)}")
        else:  # capitals, a phone number, a version
            paragraphs.append(f"NOTES: the MODEL BAKER of the harbor ledger, call 555-{rng.randrange(1000, 9999)}, "
                              f"version {rng.randrange(1, 9)}.{rng.randrange(30)}.{rng.randrange(99)}.")
    return "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def hay_file(tmp_path_factory):
    """A haystack file of six documents separated by form feeds."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("haystack") / "ledgers.txt"
    path.write_text("\n\f\n".join(haystack_document(rng, d + 1) for d in range(6)) + "\n")
    return path


def flat(text: str) -> str:
    return " ".join(text.split())


def needle_sentences(sample: Sample) -> list[str]:
    return re.findall(r"(?:The special magic number for|One of the special magic numbers for|The variable) [^\n]*?\.(?= |$)",
                      sample.context, flags=re.M)


def filler(sample: Sample) -> str:
    """The context without its preamble and its needles."""
    body = sample.context.split("\n\n", 1)[1]
    for needle in needle_sentences(sample):
        body = body.replace(needle, "")
    return body


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_haystack_samples_are_deterministic_and_named(words, hay_file, name):
    first = make_task(name, words, 3, 600, seed=1, haystack=hay_file)
    assert first == make_task(name, words, 3, 600, seed=1, haystack=str(hay_file))
    assert make_task(name, words, 2, 600, seed=1, haystack=load_haystack(hay_file)) == first[:2]
    other = make_task(name, words, 3, 600, seed=2, haystack=hay_file)
    assert all(a.context != b.context and a.answers != b.answers for a, b in zip(first, other, strict=True))
    assert len({s.context for s in first}) == 3
    tag = "ledgers." + hashlib.sha256(hay_file.read_bytes()).hexdigest()[:8]
    assert [s.id for s in first] == [f"{name}-{tag}-1-{i}" for i in range(3)]
    assert load_haystack(hay_file).id == f"ledgers.txt:{tag.split('.')[1]}"
    default = make_task(name, words, 3, 600, seed=1)
    assert not {s.id for s in default} & {s.id for s in first}  # a resumed run can never take one for the other
    assert all(a.context != b.context for a, b in zip(first, default, strict=True))


@pytest.mark.parametrize("name", BUILTIN_TASKS)
@pytest.mark.parametrize("size", [300, 1500])
def test_haystack_context_length_is_within_ten_percent(words, hay_file, name, size):
    for sample in make_task(name, words, 2, size, seed=0, haystack=hay_file):
        assert abs(n_tokens(words, sample.context) - size) <= 0.1 * size


@pytest.mark.parametrize("name", HAYSTACK_TASKS)
def test_haystack_needles_occur_once_and_answers_nowhere_else(words, hay_file, name):
    for sample in make_task(name, words, 6, 800, seed=0, haystack=hay_file):
        needles = needle_sentences(sample)
        assert len(needles) == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "vt": 3}[name]
        assert all(sample.context.count(needle) == 1 for needle in needles)
        rest = filler(sample).lower()
        assert re.search(r"\d{5}", rest)  # the filler's own numbers are there
        drawn = list(sample.answers)
        if name == "vt":
            drawn += re.findall(r"set to (\d+)", sample.question)
        else:
            drawn += re.findall(r"for (\w+-\w+) ", sample.question)
        for text in drawn:
            assert text.lower() not in rest, (sample.id, text)
            assert any(text in needle for needle in needles)


def test_haystack_draws_again_when_a_value_is_in_the_filler(words, hay_file, monkeypatch):
    calls = []
    vt = tasks._GENERATORS["vt"]
    monkeypatch.setitem(tasks._GENERATORS, "vt", lambda *args: calls.append(1) or vt(*args))
    samples = make_task("vt", words, 8, 1200, seed=0, haystack=hay_file)
    assert len(calls) > len(samples)  # 5-digit values often sit inside the table's numbers: drawn again
    for sample in samples:
        (value,) = re.findall(r"set to (\d+)", sample.question)
        assert value not in filler(sample)
    monkeypatch.setattr(tasks, "_numbers", lambda rng, count, digits: ["555"] * count)  # in every "call 555-..."
    with pytest.raises(ValueError, match="in 50 draws.*ledgers.txt"):
        make_task("vt", words, 1, 1200, seed=0, haystack=hay_file)


@pytest.mark.parametrize("name", HAYSTACK_TASKS)
def test_haystack_filler_comes_from_the_file(words, hay_file, name):
    text = flat(hay_file.read_text())
    paragraph_starts = {flat(p.split("\n")[0]) for p in re.split(r"\n\s*\n", hay_file.read_text().replace("\f", ""))}
    prose = {flat(p)[:40] for p in haystack_text().split("\n\n") if len(flat(p)) > 40}
    for sample in make_task(name, words, 3, 800, seed=0, haystack=hay_file):
        lines = [flat(line) for line in filler(sample).splitlines() if line.strip()]
        assert all(line in text for line in lines)
        assert lines[0] in paragraph_starts  # a sample starts at a paragraph (or document) start
        assert not any(start in flat(sample.context) for start in prose)


def test_haystack_cwe_words_come_from_the_file_but_not_its_dominant_words(words, hay_file):
    file_words = set(re.findall(r"[a-z]+", hay_file.read_text()))
    for sample in make_task("cwe", words, 4, 1200, seed=0, haystack=hay_file):
        counts = Counter(re.findall(r"^\d+\. (\S+)$", sample.context, flags=re.M))
        assert set(counts) <= file_words
        assert sorted(w for w, _ in counts.most_common(len(sample.answers))) == sorted(sample.answers)
        assert not set(sample.answers) & set(DOMINANT)
        assert not set(counts) & set(DOMINANT)
        assert not any(a in w for a in sample.answers for w in counts if w != a)


def test_haystack_too_short_names_the_fix(words, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("A short note with 12 words and a number 345.\n\nAnother paragraph here, also short.\n")
    with pytest.raises(ValueError, match=r"haystack .*short.txt is too short .*context_tokens=800.*longer file.*--context-tokens"):
        make_task("niah_single", words, 1, 800, seed=0, haystack=path)


def test_load_haystack_reads_documents_and_paragraphs(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("Title\n\nFirst line.\n  indented 12. Second sentence.\n\n\n\nLast paragraph.\n")
    haystack = load_haystack(one)
    assert haystack.units == (("Title", "\n\n"), ("First line.", "\n"), ("  indented 12.", " "),
                              ("Second sentence.", "\n\n"), ("Last paragraph.", "\n\n"))  # fmt: skip
    assert haystack.starts == (0, 1, 4) and haystack.name == "one.txt"
    assert haystack.digest == hashlib.sha256(one.read_bytes()).hexdigest() and haystack.tag == f"one.{haystack.digest[:8]}"
    two = tmp_path / "two docs.txt"
    two.write_text("Doc one, line one.\nline two\n\f\nDoc two.\n")
    assert load_haystack(two).starts == (0, 2) and load_haystack(two).tag.startswith("two_docs.")
    with pytest.raises(FileNotFoundError, match="haystack file not found: .*nope.txt"):
        load_haystack(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n\f\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        load_haystack(tmp_path / "empty.txt")


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
