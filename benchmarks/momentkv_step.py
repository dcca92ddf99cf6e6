"""MomentKV's correction: the cost of one decode step's attention with and without the moments (issue: MomentKV).

    .venv/bin/python benchmarks/momentkv_step.py --entries 128 512 2048 --threads 1

One layer with SmolLM2's shapes (3 KV heads, 9 query heads, d = 64), one decode query, the
real read path (``kvcompress.read.read``). Rows: entries held; the plain read (the exact SDPA
path, what eviction methods use); the masked read without a summary (the path a layer with
votes or ragged heads takes); the same with MomentKV's moments merged. Ratios are within
one run; the whole-model decode ratio is in ``kvcompress bench``.
"""

from __future__ import annotations

import argparse
import time
import torch

from kvcompress.methods.momentkv import Moments
from kvcompress.read import read
from kvcompress.store.view import KVView


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, g, d = args.heads, args.group, args.dim
    print("| entries | plain read (SDPA) µs | masked read µs | + moments µs | moments ÷ masked | moments ÷ SDPA |")
    print("|---|---|---|---|---|---|")
    for n in args.entries:
        keys, values = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
        positions = torch.arange(n).expand(1, h, n)
        evicted = torch.randn(1, h, 4 * n, d, generator=gen)
        moments = Moments.empty(1, h, d, "cpu").add(evicted, torch.randn(1, h, 4 * n, d, generator=gen), torch.ones(1, h, 4 * n, dtype=torch.bool))
        query = torch.randn(1, h * g, 1, d, generator=gen)
        position = torch.tensor([[5 * n]])
        plain_view = KVView.of(keys, values, positions)
        moment_view = KVView.of(keys, values, positions, summary=moments)

        with torch.inference_mode():
            plain = timed(lambda: read(query, position, plain_view, d**-0.5), args.repeats)
            ref = timed(lambda: read(query, position, plain_view, d**-0.5, need_lse=True), args.repeats)
            corrected = timed(lambda: read(query, position, moment_view, d**-0.5), args.repeats)
        print(f"| {n} | {plain * 1e6:.0f} | {ref * 1e6:.0f} | {corrected * 1e6:.0f} | {corrected / ref:.2f} | {corrected / plain:.2f} |")


if __name__ == "__main__":
    main()
