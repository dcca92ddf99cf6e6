"""``kvcompress eval --ray``: the same sweep, sharded by sample over Ray actors (needs ``kvcompress[ray]``).

The sample is the unit of work: its prefill is shared by every method × size of the grid
(``runner._run_sample``), so a worker runs a whole sample's grid and returns its predictions.
Each worker (one Ray actor, ``threads`` CPUs) loads the model once and builds the grid from the
settings; the driver makes the samples (task files and haystacks are read on its machine only),
hands them out as workers free up, shows one progress bar, passes each prediction to
``on_prediction`` as it arrives (so ``predictions.jsonl`` grows and ``--resume`` works as without
Ray), and lists the predictions in the single-process order. A worker that dies has its sample
run again on a fresh worker (``MAX_ATTEMPTS`` tries in all, then the run fails naming the sample);
a worker that cannot load the model fails the run at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import RayActorError
from tqdm import tqdm

from .runner import (EvalSettings, Prediction, aggregate, checked_grid, in_grid_order, key_of, load_samples, method_grid,
                     sample_predictions, todo)
from .tasks import Sample

MAX_ATTEMPTS = 3


@dataclass
class Workers:
    """Where and how wide to shard: ``count`` actors (None: one per ``threads`` CPUs of the cluster) of ``threads``
    CPUs each, on the cluster at ``address`` (None: the one this process joined, else a new local one).
    ``load`` builds (model, tokenizer) in each actor (e.g. ``functools.partial(load_model, name)``); without it
    the driver's model and tokenizer are shipped through Ray's object store."""

    count: int | None = None
    threads: int = 1
    address: str | None = None
    load: Callable | None = None

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise ValueError(f"--workers must be ≥ 1, got {self.count}")
        if self.threads < 1:
            raise ValueError(f"threads per worker must be ≥ 1, got {self.threads}")


class EvalWorker:
    """One shard's process: the model and the grid, built once."""

    def __init__(self, load, settings: EvalSettings, threads: int):
        torch.set_num_threads(threads)
        self.model, self.tokenizer = load() if callable(load) else load  # Ray resolved the object-store reference
        self.settings = settings
        self.grid = method_grid(settings)

    def run(self, sample: Sample, methods: list[int]) -> list[Prediction]:
        """The predictions of the grid's methods at these indices on one sample."""
        chosen = [self.grid[i] for i in methods]
        return list(sample_predictions(self.model, self.tokenizer, sample, self.grid, chosen, self.settings))


def run_eval(model, tokenizer, settings: EvalSettings, workers: Workers | None = None, progress: bool = True,
             on_prediction: Callable[[Prediction], None] | None = None,
             done: dict[tuple, Prediction] | None = None) -> tuple[list[dict], list[Prediction], float]:
    """``runner.run_eval`` sharded over Ray actors: the same (rows, predictions, wall seconds), the same
    predictions in the same order apart from their timings."""
    workers = workers or Workers()
    grid = checked_grid(settings, model)
    samples = load_samples(settings, tokenizer)
    done = done or {}
    if not ray.is_initialized():
        ray.init(address=workers.address, log_to_driver=False)
    start = time.perf_counter()
    queue = [(s, _indices(grid, todo(s, grid, done))) for s in samples]
    queue = [(s, methods) for s, methods in queue if methods]
    made: dict[tuple, Prediction] = {}
    total = len(samples) * len(grid)
    bar = tqdm(total=total, initial=total - sum(len(m) for _, m in queue), desc="eval", disable=not progress, unit="run")
    if queue:
        count = workers.count or max(1, int(ray.cluster_resources().get("CPU", 1)) // workers.threads)
        actor = ray.remote(num_cpus=workers.threads)(EvalWorker)
        load = workers.load or ray.put((model, tokenizer))
        _drain(queue, lambda: actor.remote(load, settings, workers.threads), min(count, len(queue)), bar, made, on_prediction)
    bar.close()
    predictions = in_grid_order(samples, grid, {**done, **made})
    return aggregate(predictions), predictions, time.perf_counter() - start


def _indices(grid: list, methods: list) -> list[int]:
    chosen = {id(m) for m in methods}
    return [i for i, m in enumerate(grid) if id(m) in chosen]


def _drain(queue: list, start_worker: Callable, count: int, bar, made: dict, on_prediction) -> None:
    """Hand samples to ``count`` workers as they free up until every one is done; a dead worker's sample goes
    back to the head of the queue, and a fresh worker takes its place."""
    attempts: dict[tuple, int] = {}
    idle = [start_worker() for _ in range(count)]
    running: dict = {}  # the pending result → (worker, sample, methods)
    try:
        while queue or running:
            while queue and idle:
                worker = idle.pop()
                sample, methods = queue.pop(0)
                running[worker.run.remote(sample, methods)] = (worker, sample, methods)
            ready, _ = ray.wait(list(running), num_returns=1)
            worker, sample, methods = running.pop(ready[0])
            try:
                predictions = ray.get(ready[0])
            except RayActorError as error:
                if error.actor_init_failed:  # the model did not load: the same again on every worker
                    raise RuntimeError(f"a Ray worker could not load the model: {error}") from None
                key = (sample.task, sample.id)
                attempts[key] = attempts.get(key, 1) + 1
                if attempts[key] > MAX_ATTEMPTS:
                    raise RuntimeError(f"sample {sample.task}/{sample.id} lost its worker {MAX_ATTEMPTS} times; the last: "
                                       f"{error}") from None
                queue.insert(0, (sample, methods))
                idle.append(start_worker())
                continue
            idle.append(worker)
            for prediction in predictions:
                made[key_of(prediction)] = prediction
                if on_prediction is not None:
                    on_prediction(prediction)
            bar.update(len(predictions))
    finally:  # the workers' models are freed with them, also when the run stops early
        for worker in idle + [w for w, _, _ in running.values()]:
            ray.kill(worker)


__all__ = ["EvalWorker", "Workers", "run_eval"]
