"""``kvcompress eval``: task accuracy for methods × budgets (or ratios) × tasks.

Prefill once, compress many (DESIGN.md, "Evaluation protocol"): each sample's prefix is
prefilled once into an uncompressed cache that also records what every method scores with;
each method × budget then compresses a fork of it and decodes the question and answer on
its own copy. ``share_prefill=False`` runs every configuration from its own prefill
(the same numbers, slower) to check that sharing changes nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from statistics import mean

from tqdm import tqdm

from ..hf import CompressedCache
from ..generate import GenerateOutput, answer, build_prompt, check_inputs, prefill
from ..methods import MethodSpec, Policy, get_method
from .metrics import score
from .tasks import BUILTIN_TASKS, MAX_NEW_TOKENS, Sample, load_haystack, load_task_file, make_task

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass
class EvalSettings:
    """Everything that defines an eval run (stored in results.json as ``settings``)."""

    methods: list[str]
    budgets: list[int] | None = None
    ratios: list[float] | None = None
    tasks: list[str] = field(default_factory=lambda: list(BUILTIN_TASKS))
    task_files: list[str] = field(default_factory=list)
    limit: int | None = None  # samples per task file (None: all); ``samples`` is per built-in task
    samples: int = 10
    context_tokens: int = 1536
    seed: int = 0
    query_aware: bool = False
    share_prefill: bool = True
    max_new_tokens: int | None = None
    haystack: str | None = None  # a text file whose text fills the built-in tasks (None: the built-in prose)
    haystack_id: str | None = field(default=None, init=False)  # its name and hash (``heldout.txt:1a2b3c4d``), set here

    def __post_init__(self) -> None:
        if self.budgets and self.ratios:
            raise ValueError("give --budgets or --ratios, not both")
        if not self.budgets and not self.ratios:
            self.ratios = [0.1, 0.25, 0.5]
        if self.samples < 1:
            raise ValueError(f"samples must be ≥ 1, got {self.samples}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be ≥ 1 (samples per task file), got {self.limit}")
        unknown = sorted(set(self.tasks) - set(BUILTIN_TASKS))
        if unknown:
            raise ValueError(f"unknown task {', '.join(unknown)}; built-in tasks: {', '.join(BUILTIN_TASKS)} (or --task-file)")
        if self.haystack is not None:
            if not self.tasks:
                raise ValueError("--haystack fills the built-in tasks, but none is asked: add --tasks (or leave --haystack out)")
            self.haystack = str(self.haystack)
            self.haystack_id = load_haystack(self.haystack).id  # a missing or empty file fails here, before any work


def method_grid(settings: EvalSettings) -> list[Policy]:
    """``full`` once, then every other method at every budget or ratio (validated up front); adaptive
    methods (``needs_budget = False``, e.g. gvote) choose their own budget and run once, and so does a
    method whose spec carries its own size (``snapkv:budget=16``)."""
    grid = [get_method("full")]
    sizes = [("budget", b) for b in settings.budgets or []] + [("ratio", r) for r in settings.ratios or []]
    for text in settings.methods:
        spec = MethodSpec.parse(text)
        if spec.name == "full" and not spec.options:
            continue
        if not spec.takes_size or spec.sized:
            grid.append(spec.build())
            continue
        for kind, value in sizes:
            grid.append(spec.build(**{kind: value}))
    return grid


def load_samples(settings: EvalSettings, tokenizer) -> list[Sample]:
    """Built-in tasks generated for this tokenizer (on ``settings.haystack`` when given), then the samples of every task file."""
    haystack = load_haystack(settings.haystack) if settings.haystack and settings.tasks else None
    if haystack is not None and haystack.id != settings.haystack_id:
        raise ValueError(f"haystack {settings.haystack} changed since these settings were made ({settings.haystack_id}, "
                         f"now {haystack.id}): run again")
    samples = [s for task in settings.tasks
               for s in make_task(task, tokenizer, settings.samples, settings.context_tokens, settings.seed, haystack=haystack)]
    for path in settings.task_files:
        samples.extend(load_task_file(path)[: settings.limit])
    if not samples:
        raise ValueError("no samples: choose --tasks or give --task-file")
    return samples


@dataclass
class Prediction:
    """One sample × method × budget (a predictions.jsonl line)."""

    id: str
    task: str
    method: str
    budget: int | None
    ratio: float | None
    answer: str
    score: float
    correct: bool
    kr: float
    stats: dict
    question: str = ""  # what was asked, and the reference answers the score is against (to audit a score)
    references: list[str] = field(default_factory=list)


def run_eval(model, tokenizer, settings: EvalSettings, progress: bool = True,
             on_prediction: Callable[[Prediction], None] | None = None,
             done: dict[tuple, Prediction] | None = None) -> tuple[list[dict], list[Prediction], float]:
    """Run the grid on every sample; returns (aggregated rows, predictions, wall seconds).

    ``on_prediction`` sees each prediction as soon as it exists (the CLI appends it to
    predictions.jsonl, so a long run that stops early keeps what it did). ``done`` holds the
    predictions of an interrupted run by ``prediction_key``: they are not run again, and the
    result is the same list, in the same order, as an uninterrupted run's. ``eval/ray.py`` runs
    the same samples sharded over Ray actors.
    """
    grid = checked_grid(settings, model)
    samples = load_samples(settings, tokenizer)
    done = done or {}
    start = time.perf_counter()
    made: dict[tuple, Prediction] = {}
    bar = tqdm(total=len(samples) * len(grid), desc="eval", disable=not progress, unit="run")
    for sample in samples:
        methods = todo(sample, grid, done)
        bar.update(len(grid) - len(methods))
        for prediction in sample_predictions(model, tokenizer, sample, grid, methods, settings):
            made[key_of(prediction)] = prediction
            if on_prediction is not None:
                on_prediction(prediction)
            bar.update(1)
    bar.close()
    predictions = in_grid_order(samples, grid, {**done, **made})
    return aggregate(predictions), predictions, time.perf_counter() - start


def checked_grid(settings: EvalSettings, model) -> list[Policy]:
    """The grid, every method checked against the model first (one that cannot run fails before any sample)."""
    grid = method_grid(settings)
    for method in grid:
        method.check_model(model.config)
    return grid


def todo(sample: Sample, grid: list[Policy], done: dict[tuple, Prediction]) -> list[Policy]:
    """The methods of ``grid`` not yet run on ``sample``."""
    return [m for m in grid if prediction_key(sample.task, sample.id, m.variant, m.budget, m.ratio) not in done]


def key_of(prediction: Prediction) -> tuple:
    return prediction_key(prediction.task, prediction.id, prediction.method, prediction.budget, prediction.ratio)


def in_grid_order(samples: list[Sample], grid: list[Policy], by_key: dict[tuple, Prediction]) -> list[Prediction]:
    """Every sample × method's prediction, sample by sample, each in the grid's order (how a run lists them)."""
    return [by_key[prediction_key(s.task, s.id, m.variant, m.budget, m.ratio)] for s in samples for m in grid]


def sample_predictions(model, tokenizer, sample: Sample, grid: list[Policy], methods: list[Policy],
                       settings: EvalSettings) -> Iterator[Prediction]:
    """The predictions of ``methods`` (a part of ``grid``, in its order) on one sample, each as it is made."""
    outputs = _run_sample(model, tokenizer, sample, grid, methods, settings)
    for method, out in zip(methods, outputs):
        yield _prediction(sample, method, out)


def count_runs(settings: EvalSettings, tokenizer) -> int:
    """How many sample × method × size runs ``settings`` makes."""
    return len(load_samples(settings, tokenizer)) * len(method_grid(settings))


def prediction_key(task: str, sample_id: str, method: str, budget: int | None, ratio: float | None) -> tuple:
    """What identifies one run of an eval (a predictions.jsonl line)."""
    return (task, sample_id, method, budget, ratio)


def _run_sample(model, tokenizer, sample: Sample, grid: list[Policy], todo: list[Policy], settings: EvalSettings):
    """Yield the output of each method of ``todo`` (a part of ``grid``, in its order) on one sample, as each
    finishes. The shared prefill observes for the whole grid, so a resumed run prefills as the first did."""
    prompt = build_prompt(tokenizer, sample.context, sample.question)
    max_new = settings.max_new_tokens or MAX_NEW_TOKENS.get(sample.task, DEFAULT_MAX_NEW_TOKENS)
    check_inputs(model, sample.context, prompt, max_new)
    qa = settings.query_aware
    if not todo:
        return
    if not settings.share_prefill:
        for method in todo:
            cache = CompressedCache(model, method, tokenizer=tokenizer)
            logits, wall = prefill(model, cache, prompt, qa)
            out = answer(model, tokenizer, cache, prompt, logits, max_new_tokens=max_new, query_aware=qa)
            out.stats["prefill_s"] = wall - out.stats["compress_s"]
            yield out
        return
    shared = CompressedCache.shared(model, grid, tokenizer)
    logits, wall = prefill(model, shared, prompt, qa)
    for method in todo:
        fork = shared.fork(method)
        out = answer(model, tokenizer, fork, prompt, logits, max_new_tokens=max_new, query_aware=qa)
        fork.release()  # its slots in the shared pool are free for the next method
        out.stats["prefill_s"] = wall - shared.timings.get("replay_s", 0.0)  # the one shared prefill this sample cost
        yield out


def _prediction(sample: Sample, method: Policy, out: GenerateOutput) -> Prediction:
    value = score(out.text, sample.answers, sample.metric)
    return Prediction(
        id=sample.id, task=sample.task, method=method.variant, budget=method.budget, ratio=method.ratio,
        answer=out.text, score=value, correct=value >= 1.0, kr=out.stats["kr"], stats=out.stats,
        question=sample.question, references=list(sample.answers),
    )


ROW_STATS = ("kr", "cr", "kv_bytes", "kv_bytes_full", "entries_per_head", "prefill_s", "compress_s", "decode_ms_per_token")


def aggregate(predictions: list[Prediction]) -> list[dict]:
    """Mean score (0–100) and costs per method × budget × task, plus a macro average ``task="all"``."""
    groups: dict[tuple, list[Prediction]] = defaultdict(list)
    for p in predictions:
        groups[(p.method, p.budget, p.ratio, p.task)].append(p)
    rows = [_row(key, members) for key, members in groups.items()]
    by_config: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_config[(row["method"], row["budget"], row["ratio"])].append(row)
    for (method, budget, ratio), task_rows in by_config.items():
        if len(task_rows) > 1:
            overall = {"method": method, "budget": budget, "ratio": ratio, "task": "all", "n": sum(r["n"] for r in task_rows)}
            overall["score"] = mean(r["score"] for r in task_rows)
            overall.update({k: mean(r[k] for r in task_rows) for k in ROW_STATS})
            rows.append(overall)
    return rows


def _row(key: tuple, members: list[Prediction]) -> dict:
    method, budget, ratio, task = key
    row = {"method": method, "budget": budget, "ratio": ratio, "task": task, "n": len(members)}
    row["score"] = 100 * mean(p.score for p in members)
    row.update({k: mean(p.stats[k] for p in members) for k in ROW_STATS})
    return row


def prediction_record(p: Prediction) -> dict:
    """The predictions.jsonl line (DESIGN.md) plus the score, the sample's cost and prompt length."""
    record = asdict(p)
    stats = record.pop("stats")
    record.update({k: stats[k] for k in (*ROW_STATS, "prompt_tokens")})
    return record


def prediction_from_record(record: dict) -> Prediction:
    """A predictions.jsonl line back as the Prediction it was written from (what ``aggregate`` needs)."""
    stats = {k: record[k] for k in (*ROW_STATS, "prompt_tokens")}
    return Prediction(id=record["id"], task=record["task"], method=record["method"], budget=record["budget"], ratio=record["ratio"],
                      answer=record["answer"], score=record["score"], correct=record["correct"], kr=record["kr"], stats=stats,
                      question=record["question"], references=record["references"])
