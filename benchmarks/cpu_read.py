"""The CPU paged decode read (``read/paged.py``'s compiled kernel) alone: one layer's read of a decoding step.

    python benchmarks/cpu_read.py [--out runs/cpu_read.json] [--threads 2]

Shapes of the two models the project measures on: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and
Qwen2.5-Coder-0.5B (14 query heads, 2 KV heads, head_dim 64); 8 rows (the engine's decoding requests); 250 entries per
head (SnapKV at a tenth of 2000 tokens plus what decoding added), 2000 and 8000 (the full cache); pools in float32 and
bfloat16 holding every row's entries, each at a random slot (as a pool that has served for a while holds them), plus
as many unused slots again. Each case: the median of 7 rounds of 200 calls (a round's mean), the kernel called as the
engine calls it (``paged_decode``: the query in the pool's dtype, the output back in it), and the bytes a read must move
(each entry's slot, key and value; the query and output) over that time. Prints a table; writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvcompress.kernels import cpu_kernels
from kvcompress.read.paged import paged_decode

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-coder-0.5b": (14, 2, 64)}
ROWS, CONTEXTS, DTYPES = 8, (250, 2000, 8000), (torch.float32, torch.bfloat16)


def case(shape: str, context: int, dtype: torch.dtype, seed: int = 0):
    """(query, keys, values, tables, lengths, bytes moved) of one layer's read."""
    hq, heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    entries = ROWS * heads * context
    slots = 1 + torch.randperm(2 * entries, generator=gen)[:entries]
    keys, values = (torch.randn(2 * entries + 1, dim, generator=gen).to(dtype) for _ in range(2))
    tables = [t.view(heads, context).int() for t in slots.view(ROWS, -1)]
    query = torch.randn(ROWS, hq, dim, generator=gen).to(dtype)
    moved = entries * (4 + 2 * dim * keys.element_size()) + 2 * query.numel() * query.element_size()
    return query, keys, values, tables, torch.full((ROWS, heads), context), moved


def timed(call, rounds: int = 7, calls: int = 200) -> float:
    """Median over rounds of a call's mean seconds."""
    for _ in range(20):
        call()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/cpu_read.json"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("the CPU kernel is not built here (see read/paged.py); nothing to measure")
    torch.set_num_threads(args.threads)
    rows = []
    print("| model shape | entries per head | pool dtype | µs per layer | GB/s |\n|---|---|---|---|---|")
    for shape in SHAPES:
        for context in CONTEXTS:
            for dtype in DTYPES:
                query, keys, values, tables, lengths, moved = case(shape, context, dtype)
                seconds = timed(lambda: paged_decode(query, keys, values, tables, lengths, None, 0.125))
                row = {"shape": shape, "rows": ROWS, "context": context, "dtype": str(dtype).removeprefix("torch."),
                       "us": seconds * 1e6, "gb_per_s": moved / seconds / 1e9, "threads": args.threads}
                rows.append(row)
                print(f"| {shape} | {context} | {row['dtype']} | {row['us']:.1f} | {row['gb_per_s']:.1f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
