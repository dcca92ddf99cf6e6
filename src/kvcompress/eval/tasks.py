"""Long-context tasks: RULER-style synthetic generators, and the JSON Lines task-file loader.

The built-in tasks follow RULER (Hsieh et al. 2024, *RULER: What's the Real Context Size of
Your Long-Context Language Models?*), generated offline and sized in tokens of the model's
own tokenizer:

==================  ===============================================================  ========
name                what the model must do                                           metric
==================  ===============================================================  ========
``niah_single``     find the one magic number hidden in filler prose                 contains
``niah_multikey``   find the number of one key among several keys' numbers           contains
``niah_multivalue`` find every number hidden for one key                             contains
``vt``              follow a chain of variable assignments (``X is set to Y``)       contains
``cwe``             name the few words that dominate a long numbered list            contains
==================  ===============================================================  ========

The filler is :func:`kvcompress.demo.haystack_text` (original prose with no digits, so
numbers can only come from the needles), rotated so that samples start on different essays.
Each sample has its own random generator seeded from ``(task, seed, index)``: the same seed
gives the same samples, and sample ``i`` does not depend on how many samples were asked for.

**Another haystack** (``make_task(..., haystack=FILE)``, ``kvcompress eval --haystack FILE``):
the learned methods (retention gates, DeltaKV codecs) were trained on that prose, so a score on
it overstates them; ``runs/corpus/heldout.txt`` (``kvcompress corpus``) is text they never saw.
A haystack file is read as documents separated by a form feed (``\\f``, as the corpus writes
them; a file without one is one document), paragraphs split on blank lines, and each line
(and each sentence of a line) is a place where a needle may go; the text keeps its own lines
and indentation. A sample starts at the beginning of a paragraph (a document's start is one)
and its filler runs on through the text that follows, across documents (after the last, the
first); the paragraph is the one holding a random line of the file, so every part of the file
is as likely to be used whatever its paragraph lengths. A needle takes over the line break (or
space) of the place it is put, so it stands on a line of its own between lines, or as a
sentence between sentences. A file whose whole text is shorter than ``context_tokens`` is
refused (``ValueError``) rather than repeated. Samples are the same for the same seed and the
same file; their ids carry the file's name and the first 8 hex digits of its SHA-256
(``niah_single-heldout.1a2b3c4d-0-3``) and :class:`Haystack` ``.id`` (``heldout.txt:1a2b3c4d``)
is what eval settings record, so a resumed or merged eval never mixes haystacks. Real text has
digits and capitals, which the built-in prose has not; so, for a haystack file only:

* niah_* and vt: every string a sample draws (the 7-digit values, the keys, vt's 5-digit value
  and its variable names) must occur in the context only inside its needles (compared
  case-blind, as the ``contains`` metric reads the answer, and as substrings, so ``1234567``
  inside a longer number of the filler counts). A sample where one does is drawn again, values
  and filler start alike, from the same generator (so still deterministic; after 50 tries it is
  a ``ValueError``). The filler's own numbers stay: they are distractors a model must not
  answer with, as the numbers of RULER's essays are.
* cwe has no filler prose: its list draws its words from the haystack file in use (its
  lower-case words of 4-10 letters, as with the built-in prose), less the file's most frequent
  words (the 100 most frequent, or a quarter of its vocabulary when that is fewer) besides the
  usual stop words: the few words that dominate the text (``that``, ``with``, ``file``, ``commit``
  in the held-out corpus) are never the answer, so naming the haystack's common words scores
  nothing.

The built-in prose keeps its generation exactly as it was (no check, no redraw: the same
samples as before this option existed).

The ``question`` is kept apart from the ``context`` and states the task on its own, because
the default protocol compresses the context before the question is seen (DESIGN.md,
"Evaluation protocol"). :data:`MAX_NEW_TOKENS` gives each task's answer length.

Measured on the embedded SmolLM2-135M-Instruct with the full cache (seed 0, 10 samples per
cell, greedy; query-aware gives the same answers): niah_single 100 / 100, niah_multikey
60 / 50 (picking one of the 4 numbers at random: 25), niah_multivalue 57.5 / 65, vt 46.7 /
43.3, cwe 36 / 36 at 1024 / 1536 context tokens. For cwe that is above naming 5 distinct
words of the list at random (5-7) but not above naming 5 entries drawn from the list (about
47): the model does not really count.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ..demo import haystack_text
from ..train.corpus import split_documents
from .metrics import METRICS


@dataclass
class Sample:
    """One question about one context, with its reference answers and how to score them."""

    id: str
    context: str
    question: str
    answers: list[str]
    task: str
    metric: str

    def to_dict(self) -> dict:
        """The sample as a task-file row (DESIGN.md, "Task files")."""
        return asdict(self)


BUILTIN_TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")

# Greedy decoding budget per task: enough for the full answer plus a little slack.
MAX_NEW_TOKENS: dict[str, int] = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "vt": 40,
    "cwe": 64,
}

# Number of needles / values / hops / common words (see the generators).
NIAH_MULTIKEY_KEYS = 4
NIAH_MULTIVALUE_VALUES = 4
VT_HOPS = 2
CWE_WORDS = 5
CWE_SHARE = 0.6  # fraction of list entries taken by the common words
CWE_DOMINANT = 100  # a haystack file's most frequent words, never cwe's words
MAX_DRAWS = 50  # a haystack file's sample is drawn again at most this often (module docstring)


_NIAH_PREAMBLE = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize them. I will quiz you about the numbers afterwards.\n\n"
)
_VT_PREAMBLE = (
    "Some variables are set to values in the following text. "
    "Memorize them. I will quiz you about them afterwards.\n\n"
)
_CWE_PREAMBLE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n\n"
)

# Keys for the magic numbers: "adjective-noun", as RULER's keys; none occurs in the filler.
_ADJECTIVES = (
    "amber", "brave", "calm", "clever", "copper", "crimson", "curious", "daring", "dusty", "eager",
    "fancy", "fierce", "frozen", "gentle", "giant", "golden", "happy", "hidden", "humble", "jolly",
    "lazy", "lively", "lucky", "misty", "noble", "polite", "proud", "quiet", "rapid", "rusty",
    "scarlet", "shiny", "silent", "silver", "sleepy", "swift", "tender", "tiny", "velvet", "witty",
)  # fmt: skip
_NOUNS = (
    "badger", "beetle", "buffalo", "camel", "cobra", "condor", "coyote", "dolphin", "donkey", "falcon",
    "ferret", "flamingo", "gazelle", "gecko", "giraffe", "gorilla", "hamster", "hedgehog", "heron", "iguana",
    "jackal", "jaguar", "koala", "lemur", "leopard", "lobster", "llama", "mongoose", "octopus", "otter",
    "panther", "parrot", "pelican", "penguin", "raccoon", "salmon", "sparrow", "tortoise", "walrus", "zebra",
)  # fmt: skip
_GOLDEN = (math.sqrt(5) - 1) / 2


# --------------------------------------------------------------------------- filler

# A unit is ``(text, separator after it)``: a sentence or a line, where a needle may go.
Unit = tuple[str, str]


@functools.lru_cache(maxsize=1)
def _units() -> tuple[tuple[Unit, ...], tuple[int, ...]]:
    """The built-in prose as sentences, and the indices where essays start."""
    units: list[Unit] = []
    starts: list[int] = []
    for block in haystack_text().split("\n\n"):
        block = " ".join(block.split())
        if not block:
            continue
        if block[-1] not in ".!?\"'":  # a title: a new essay starts here
            starts.append(len(units))
            units.append((block, "\n\n"))
            continue
        sentences = re.split(r"(?<=[.!?])\s+", block)
        units.extend((sentence, "\n\n" if i == len(sentences) - 1 else " ") for i, sentence in enumerate(sentences))
    return tuple(units), tuple(starts or [0])


@dataclass(frozen=True, eq=False)
class Haystack:
    """A text file as the filler of the built-in tasks, read by :func:`load_haystack` (module docstring)."""

    path: str
    name: str  # the file's name
    digest: str  # SHA-256 of its bytes, hex
    units: tuple[Unit, ...]
    starts: tuple[int, ...]  # the first unit of every paragraph

    @property
    def id(self) -> str:
        """What eval settings record: ``heldout.txt:1a2b3c4d``."""
        return f"{self.name}:{self.digest[:8]}"

    @property
    def tag(self) -> str:
        """What sample ids carry: ``heldout.1a2b3c4d``."""
        stem = re.sub(r"[^A-Za-z0-9_]+", "_", Path(self.name).stem).strip("_") or "haystack"
        return f"{stem}.{self.digest[:8]}"


_SENTENCE_END = re.compile(r"(?<=[.!?]) +")


def _file_units(text: str) -> tuple[tuple[Unit, ...], tuple[int, ...]]:
    """Documents (split at form feeds) → paragraphs (split at blank lines) → lines → sentences."""
    units: list[Unit] = []
    starts: list[int] = []
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for document in split_documents(text):
        for paragraph in re.split(r"\n[ \t]*\n", document):
            lines = [line.rstrip() for line in paragraph.split("\n")]
            lines = [line for line in lines if line.strip()]
            if not lines:
                continue
            starts.append(len(units))
            for j, line in enumerate(lines):
                body = line.lstrip()
                pieces = _SENTENCE_END.split(body)
                pieces[0] = line[: len(line) - len(body)] + pieces[0]  # the line keeps its indentation
                end = "\n\n" if j == len(lines) - 1 else "\n"
                units.extend((piece, end if i == len(pieces) - 1 else " ") for i, piece in enumerate(pieces))
    return tuple(units), tuple(starts)


_PARSED: dict[str, tuple[tuple[Unit, ...], tuple[int, ...]]] = {}


def load_haystack(path: str | Path) -> Haystack:
    """Read a haystack file (UTF-8 text; documents separated by form feeds). FileNotFoundError
    naming the path; ValueError for a file that is not UTF-8 text or holds none."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"haystack file not found: {path}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest not in _PARSED:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"haystack {path}: not UTF-8 text (byte {error.start}); give a plain text file") from None
        if len(_PARSED) >= 4:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[digest] = _file_units(text)
    units, starts = _PARSED[digest]
    if not units:
        raise ValueError(f"haystack {path} holds no text; give a text file (e.g. runs/corpus/heldout.txt)")
    return Haystack(str(path), path.name, digest, units, starts)


def _as_haystack(haystack: str | Path | Haystack | None) -> Haystack | None:
    return haystack if haystack is None or isinstance(haystack, Haystack) else load_haystack(haystack)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _unit_counts(tokenizer, units: tuple[Unit, ...], start: int, count: int) -> list[int]:
    """Tokens of ``count`` units from ``start`` on (wrapping around), each as it would follow a space."""
    rows = [" " + units[(start + j) % len(units)][0] for j in range(count)]
    return [len(ids) for ids in tokenizer(rows, add_special_tokens=False).input_ids] if rows else []


def _render(units: list[Unit]) -> str:
    return "".join(text + separator for text, separator in units).rstrip()


def _fit(tokenizer, target: int, build, estimate: int, what: str, most: int | None = None, too_short=None) -> str:
    """``build(k)`` for the size ``k`` whose token count is closest to ``target``: the count
    grows with ``k``, so bracket the target from ``estimate`` and bisect. ``most``: the largest
    ``k`` there is (``too_short`` is the error when even that falls short)."""
    counts: dict[int, int] = {}

    def count(k: int) -> int:
        if k not in counts:
            counts[k] = _count(tokenizer, build(k))
        return counts[k]

    lo = hi = max(estimate, 1)
    while count(hi) < target:  # grow until the target is bracketed
        if most is not None and hi >= most:
            if abs(count(hi) - target) > 0.1 * target:
                raise ValueError(too_short(count(hi)))
            break
        lo, hi = hi, hi + max(1, hi // 4)
        if most is not None:
            hi = min(hi, most)
        if hi > 64 * max(estimate, 1):
            break
    while lo > 1 and count(lo) > target:  # shrink until the target is bracketed
        lo, hi = max(1, lo - max(1, lo // 4)), lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) < target:
            lo = mid
        else:
            hi = mid
    best = min(counts, key=lambda k: (abs(counts[k] - target), k))
    if abs(counts[best] - target) > 0.1 * target:
        raise ValueError(
            f"cannot build a {what} context of {target} tokens (closest: {counts[best]}); ask for more context_tokens."
        )
    return build(best)


def _haystack(
    tokenizer, rng: random.Random, target: int, preamble: str, needles: list[tuple[float, str]], what: str,
    haystack: Haystack | None = None,
) -> str:
    """``preamble`` + filler prose of about ``target`` tokens in all, with each needle
    ``(depth, sentence)`` inserted between sentences at ``depth`` (0 = start, 1 = end); the filler
    is ``haystack``'s text when one is given (module docstring), the built-in prose otherwise."""
    if haystack is None:
        units, starts = _units()
        start = starts[rng.randrange(len(starts))]
    else:
        units, starts = haystack.units, haystack.starts
        start = starts[bisect.bisect_right(starts, rng.randrange(len(units))) - 1]  # the paragraph of a random line
    fixed = _count(tokenizer, preamble) + sum(_count(tokenizer, " " + text) for _, text in needles)
    if fixed >= 0.9 * target:
        raise ValueError(
            f"context_tokens={target} is too small for {what}: the instructions and needles alone take "
            f"{fixed} tokens; ask for at least {math.ceil(fixed / 0.5)}."
        )

    def too_short(tokens: int) -> str:
        return (f"haystack {haystack.path} is too short for {what} at context_tokens={target}: all of its text makes "
                f"a context of about {tokens} tokens; give a longer file (e.g. runs/corpus/heldout.txt) or ask for fewer "
                "context_tokens (--context-tokens).")

    estimate, total, counts = 0, 0, []
    while total < target - fixed:
        if haystack is not None and estimate >= len(units):
            raise ValueError(too_short(fixed + total))
        if estimate == len(counts):
            chunk = 256 if haystack is None else min(256, len(units) - estimate)
            counts += _unit_counts(tokenizer, units, start + estimate, chunk)
        total += counts[estimate]
        estimate += 1
    needles = sorted(needles, key=lambda needle: needle[0])

    def build(k: int) -> str:
        chosen = [units[(start + j) % len(units)] for j in range(k)]
        # insert from the deepest needle first so that earlier positions stay valid
        for depth, text in reversed(needles):
            at = round(min(max(depth, 0.0), 1.0) * k)
            if at == 0:
                chosen.insert(0, (text, "\n\n"))
            else:
                before, separator = chosen[at - 1]
                if haystack is None:  # in the prose a needle ends the sentence's paragraph (if it did)
                    chosen[at - 1] = (before, " ")
                chosen.insert(at, (text, separator))  # a file's line break (or space) is kept on both sides
        return preamble + _render(chosen)

    most = None if haystack is None else len(units)
    return _fit(tokenizer, target, build, estimate, what, most=most, too_short=too_short)


# --------------------------------------------------------------------------- random pieces


def _sample_rng(name: str, seed: int, index: int) -> random.Random:
    return random.Random(f"{name}:{seed}:{index}")


def _spread(name: str, seed: int, index: int) -> float:
    """A depth in [0.05, 0.95] for sample ``index``: a golden-ratio sequence, so that any
    number of samples covers the context evenly."""
    offset = random.Random(f"{name}:{seed}:depth").random()
    return 0.05 + 0.9 * ((offset + index * _GOLDEN) % 1.0)


def _strata(rng: random.Random, count: int) -> list[float]:
    """``count`` increasing depths in [0.05, 0.95], one in each of ``count`` equal strata."""
    return [0.05 + 0.9 * (j + rng.uniform(0.15, 0.85)) / count for j in range(count)]


def _keys(rng: random.Random, count: int) -> list[str]:
    """``count`` keys sharing neither adjective nor noun."""
    adjectives, nouns = rng.sample(_ADJECTIVES, count), rng.sample(_NOUNS, count)
    return [f"{a}-{n}" for a, n in zip(adjectives, nouns, strict=True)]


def _numbers(rng: random.Random, count: int, digits: int) -> list[str]:
    values: set[str] = set()
    while len(values) < count:
        values.add(str(rng.randrange(10 ** (digits - 1), 10**digits)))
    return rng.sample(sorted(values), count)


def _magic(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


# --------------------------------------------------------------------------- generators


@dataclass
class _Draft:
    """A generated sample, with what a haystack file's check needs: the needle sentences, and the
    strings the sample drew, which may occur in the context only inside those sentences."""

    context: str
    question: str
    answers: list[str]
    needles: list[str]
    drawn: list[str]


def _niah_single(tokenizer, rng: random.Random, target: int, depth: float, haystack: Haystack | None) -> _Draft:
    (key,) = _keys(rng, 1)
    (value,) = _numbers(rng, 1, 7)
    needle = _magic(key, value)
    context = _haystack(tokenizer, rng, target, _NIAH_PREAMBLE, [(depth, needle)], "niah_single", haystack)
    question = f"What is the special magic number for {key} mentioned in the text above? Answer with the number only."
    return _Draft(context, question, [value], [needle], [key, value])


def _niah_multikey(tokenizer, rng: random.Random, target: int, depth: float, haystack: Haystack | None) -> _Draft:
    keys = _keys(rng, NIAH_MULTIKEY_KEYS)
    values = _numbers(rng, NIAH_MULTIKEY_KEYS, 7)
    # the asked needle sits at this sample's depth; the others in the remaining strata
    depths = _strata(rng, NIAH_MULTIKEY_KEYS)
    asked = min(range(len(depths)), key=lambda j: abs(depths[j] - depth))
    depths[asked] = depth
    needles = [(d, _magic(k, v)) for d, k, v in zip(depths, keys, values, strict=True)]
    context = _haystack(tokenizer, rng, target, _NIAH_PREAMBLE, needles, "niah_multikey", haystack)
    question = (
        f"What is the special magic number for {keys[asked]} mentioned in the text above? "
        "Answer with the number only."
    )
    return _Draft(context, question, [values[asked]], [text for _, text in needles], keys + values)


def _niah_multivalue(tokenizer, rng: random.Random, target: int, depth: float, haystack: Haystack | None) -> _Draft:
    (key,) = _keys(rng, 1)
    values = _numbers(rng, NIAH_MULTIVALUE_VALUES, 7)
    depths = _strata(rng, len(values))
    needles = [(d, f"One of the special magic numbers for {key} is {v}.") for d, v in zip(depths, values, strict=True)]
    context = _haystack(tokenizer, rng, target, _NIAH_PREAMBLE, needles, "niah_multivalue", haystack)
    question = (
        f"What are all the special magic numbers for {key} mentioned in the text above? "
        "Answer with the numbers only, separated by commas."
    )
    return _Draft(context, question, values, [text for _, text in needles], [key, *values])


def _variable_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct pronounceable upper-case names (consonant-vowel-consonant-vowel-
    consonant, e.g. ``KODAZ``): the small model copies these far more reliably than random
    letters such as ``XQJZT``."""
    consonants, vowels = "BDFGKLMNPRSTVZ", "AEIOU"
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(2)) + rng.choice(consonants)
        if name not in names:
            names.append(name)
    return names


def _vt(tokenizer, rng: random.Random, target: int, depth: float, haystack: Haystack | None) -> _Draft:
    names = _variable_names(rng, VT_HOPS + 1)
    (value,) = _numbers(rng, 1, 5)
    statements = [f"The variable {names[0]} is set to {value}."]
    statements += [f"The variable {names[j + 1]} is set to {names[j]}." for j in range(VT_HOPS)]
    needles = list(zip(_strata(rng, len(statements)), statements, strict=True))
    context = _haystack(tokenizer, rng, target, _VT_PREAMBLE, needles, "vt", haystack)
    question = (
        f"Which variables are set to {value} in the text above, directly or through another variable? "
        "Answer with the variable names only, separated by commas."
    )
    return _Draft(context, question, names, statements, [*names, value])


_CWE_STOP = frozenset({
    "that", "this", "with", "from", "have", "they", "their", "them", "were", "what", "when", "which",
    "would", "could", "should", "there", "these", "those", "than", "then", "into", "most", "common",
    "words", "word", "list", "numbered", "answer", "only", "more", "often", "some", "appear",
})  # fmt: skip
_CWE_WORD = re.compile(r"\b[a-z]{4,10}\b")


@functools.lru_cache(maxsize=1)
def _cwe_pool() -> tuple[str, ...]:
    """Candidate words for cwe: the haystack's own lower-case words of 4-10 letters."""
    words = set(_CWE_WORD.findall(haystack_text())) - _CWE_STOP
    return tuple(sorted(words))


_FILE_POOLS: dict[str, tuple[str, ...]] = {}


def _file_cwe_pool(haystack: Haystack) -> tuple[str, ...]:
    """Candidate words for cwe on a haystack file: its lower-case words of 4-10 letters, less the
    stop words and its :data:`CWE_DOMINANT` most frequent words (module docstring)."""
    if haystack.digest not in _FILE_POOLS:
        counts: Counter[str] = Counter()
        for text, _ in haystack.units:
            counts.update(_CWE_WORD.findall(text))
        dominant = {w for w, _ in counts.most_common(min(CWE_DOMINANT, len(counts) // 4))}
        if len(_FILE_POOLS) >= 4:
            _FILE_POOLS.pop(next(iter(_FILE_POOLS)))
        _FILE_POOLS[haystack.digest] = tuple(sorted(set(counts) - dominant - _CWE_STOP))
    return _FILE_POOLS[haystack.digest]


def _cwe(tokenizer, rng: random.Random, target: int, depth: float, haystack: Haystack | None) -> _Draft:
    pool = list(_cwe_pool() if haystack is None else _file_cwe_pool(haystack))
    if haystack is not None and len(pool) < 4 * CWE_WORDS:
        raise ValueError(f"cwe: haystack {haystack.path} has only {len(pool)} candidate words (lower-case, 4-10 letters, "
                         "not among its most frequent); give a longer file.")
    common: list[str] = []
    for word in rng.sample(pool, len(pool)):
        if all(word not in other and other not in word for other in common):
            common.append(word)
        if len(common) == CWE_WORDS:
            break
    rare = [w for w in pool if all(w not in c and c not in w for c in common)]
    rng.shuffle(rare)

    def entries(n: int) -> list[str]:
        freq = max(3, round(CWE_SHARE * n / CWE_WORDS))
        others = max(n - freq * CWE_WORDS, 0)
        repeats = max(1, math.ceil(others / len(rare)))
        if repeats >= freq:
            raise ValueError(f"cwe: context too long for the word pool ({len(rare)} words); ask for fewer tokens.")
        words = common * freq + (rare * repeats)[:others]
        random.Random(f"{shuffle_seed}:{n}").shuffle(words)
        return words

    shuffle_seed = rng.randrange(2**31)

    def build(n: int) -> str:
        return _CWE_PREAMBLE + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries(n)))

    per_entry = _count(tokenizer, build(100)) - _count(tokenizer, _CWE_PREAMBLE)
    estimate = max(1, round((target - _count(tokenizer, _CWE_PREAMBLE)) * 100 / max(per_entry, 1)))
    if estimate < 3 * CWE_WORDS * 2:
        raise ValueError(f"context_tokens={target} is too small for cwe; ask for at least 256.")
    context = _fit(tokenizer, target, build, estimate, "cwe")
    question = (
        f"What are the {CWE_WORDS} most common words in the numbered list above? "
        "Answer with the words only, separated by commas."
    )
    return _Draft(context, question, common, [], [])


_GENERATORS = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "vt": _vt,
    "cwe": _cwe,
}


def _only_in_needles(draft: _Draft) -> bool:
    """Whether every drawn string occurs in the context (case-blind) only inside the needles."""
    context, needles = draft.context.lower(), [n.lower() for n in draft.needles]
    return all(context.count(s.lower()) == sum(n.count(s.lower()) for n in needles) for s in draft.drawn)


def make_task(name: str, tokenizer, samples: int, context_tokens: int, seed: int = 0,
              haystack: str | Path | Haystack | None = None) -> list[Sample]:
    """``samples`` samples of the built-in task ``name`` (one of :data:`BUILTIN_TASKS`), each
    context about ``context_tokens`` tokens of ``tokenizer`` (within a few percent; the
    question comes on top). Deterministic for a seed; sample ``i`` is the same whatever
    ``samples`` is. ``haystack``: a text file (or a :func:`load_haystack` result) whose text
    is the filler instead of the built-in prose (module docstring)."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(BUILTIN_TASKS)} (or give a task file).")
    if samples < 0:
        raise ValueError(f"samples must be ≥ 0, got {samples}.")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be ≥ 1, got {context_tokens}.")
    haystack = _as_haystack(haystack)
    prefix = name if haystack is None else f"{name}-{haystack.tag}"
    out = []
    for index in range(samples):
        rng = _sample_rng(name, seed, index)
        depth = _spread(name, seed, index)
        draft = _GENERATORS[name](tokenizer, rng, context_tokens, depth, haystack)
        draws = 1
        while haystack is not None and not _only_in_needles(draft):
            if draws == MAX_DRAWS:
                raise ValueError(f"{name}: no sample {index} in {MAX_DRAWS} draws whose numbers and names occur in haystack "
                                 f"{haystack.path} only inside the needles; give a longer or another file.")
            draft = _GENERATORS[name](tokenizer, rng, context_tokens, depth, haystack)
            draws += 1
        out.append(Sample(f"{prefix}-{seed}-{index}", draft.context, draft.question, draft.answers, name, "contains"))
    return out


# --------------------------------------------------------------------------- task files

_FIELDS = ("id", "context", "question", "answers", "task", "metric")


def _parse_row(row: object, where: str) -> Sample:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}, got {type(row).__name__}.")
    missing = [f for f in _FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}.")
    sample_id = row["id"]
    if isinstance(sample_id, bool) or not isinstance(sample_id, str | int) or str(sample_id) == "":
        raise ValueError(f"{where}: field 'id' must be a non-empty string (or an integer), got {sample_id!r}.")
    for f in ("context", "question", "task"):
        if not isinstance(row[f], str):
            raise ValueError(f"{where}: field {f!r} must be a string, got {type(row[f]).__name__}.")
    if not row["context"].strip():
        raise ValueError(f"{where}: field 'context' is empty.")
    if not row["task"].strip():
        raise ValueError(f"{where}: field 'task' is empty.")
    answers = row["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: field 'answers' must be a list of strings, got {answers!r}.")
    if not answers or not any(a.strip() for a in answers):
        raise ValueError(f"{where}: field 'answers' is empty: give at least one reference answer.")
    if row["metric"] not in METRICS:
        raise ValueError(
            f"{where}: unknown metric {row['metric']!r} in field 'metric'; known metrics: {', '.join(METRICS)}."
        )
    return Sample(str(sample_id), row["context"], row["question"], list(answers), row["task"], row["metric"])


def load_task_file(path: str | Path) -> list[Sample]:
    """Read a JSON Lines task file (DESIGN.md, "Task files"): one object per line with
    ``id``, ``context``, ``question``, ``answers`` (a list of strings), ``task`` and ``metric``
    (one of :data:`~kvcompress.eval.metrics.METRICS`); blank lines are skipped, other fields
    ignored. Raises FileNotFoundError naming the path, and ValueError naming the line and the
    field at fault."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    samples: list[Sample] = []
    seen: dict[tuple[str, str], int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno}).") from None
            sample = _parse_row(row, where)
            key = (sample.task, sample.id)
            if key in seen:
                raise ValueError(
                    f"{where}: duplicate id {sample.id!r} in task {sample.task!r} (first on line {seen[key]})."
                )
            seen[key] = number
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: the task file holds no samples.")
    return samples
