"""Where one stream's decoding step goes, method by method: the step's time and the part of it inside the compiled reads.

    .venv/bin/python benchmarks/step_split.py --methods snapkv,full,deltakv,omnikv+deltakv --out runs/step_split.json

Each method (a spec; those that take a size get ``--ratio``) prefills the same ``--context-tokens`` random tokens into a
``CompressedCache`` and decodes ``--steps`` greedy steps, as ``kvcompress bench`` does; the methods take turns,
``--rounds`` times, in one process, so a load that comes and goes falls on each alike. Every call into the compiled CPU
kernels (``kvcompress.kernels.cpu_kernels``, whoever calls it: the decoding reads, Quest's pages, DeltaKV's rebuilds) is
timed, so each step splits into the time inside them and the rest (the model's layers, the cache's own work). Reported
per method: the median step (and × the first method's) and the median time inside the kernels a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvcompress.kernels
from kvcompress.bench import cpu_description
from kvcompress.hf import CompressedCache
from kvcompress.cli import _method
from kvcompress.kernels import cpu_kernels
from kvcompress.models import cache_kwargs, load_model


class TimedKernels:
    """The compiled module, each function call's seconds added to ``spent``."""

    def __init__(self, module):
        self.module, self.spent = module, 0.0

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def timed(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.spent += time.perf_counter() - start

        return timed


@torch.inference_mode()
def decode_steps(model, spec: str, ratio: float, ids: torch.Tensor, steps: int, kernels: TimedKernels) -> tuple[list, list]:
    """One method's steps after a prefill of ``ids``: each step's seconds, and its seconds inside the kernels."""
    cache = CompressedCache(model, _method(spec, default_ratio=ratio))  # a spec without a size gets ``ratio``, as on the command line
    next_ids = model(ids, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    walls, inside = [], []
    for _ in range(steps):
        kernels.spent = 0.0
        start = time.perf_counter()
        next_ids = model(next_ids, **cache_kwargs(cache)).logits[:, -1].argmax(-1, keepdim=True)
        walls.append(time.perf_counter() - start)
        inside.append(kernels.spent)
    return walls, inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="snapkv,full,deltakv,omnikv+deltakv")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/step_split.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu_kernels()
    if module is None:
        parser.error("the compiled CPU kernels are not built here: nothing to split the step by")
    kernels = TimedKernels(module)
    kvcompress.kernels._built = kernels  # what ``cpu_kernels()`` hands every caller from now on (they look it up per call)
    model, _ = load_model()
    ids = torch.randint(100, model.config.vocab_size, (1, args.context_tokens), generator=torch.Generator().manual_seed(0))
    methods = args.methods.split(",")
    for spec in methods:  # warm-up
        decode_steps(model, spec, args.ratio, ids[:, :256], 2, kernels)
    walls: dict[str, list] = {spec: [] for spec in methods}
    inside: dict[str, list] = {spec: [] for spec in methods}
    for _ in range(args.rounds):
        for spec in methods:
            w, i = decode_steps(model, spec, args.ratio, ids, args.steps, kernels)
            walls[spec] += w
            inside[spec] += i
    rows = [{"method": spec, "step_ms": 1e3 * statistics.median(walls[spec]), "inside_kernels_ms": 1e3 * statistics.median(inside[spec]),
             "mean_step_ms": 1e3 * statistics.mean(walls[spec])} for spec in methods]
    for row in rows:
        row["step_vs_first"] = row["step_ms"] / rows[0]["step_ms"]
        print(f"{row['method']:>18}: step {row['step_ms']:6.1f} ms (× {row['step_vs_first']:.2f}), inside the kernels "
              f"{row['inside_kernels_ms']:5.1f} ms, the rest {row['step_ms'] - row['inside_kernels_ms']:6.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "args": vars(args), "cpu": cpu_description()}, indent=1, default=str))


if __name__ == "__main__":
    main()
