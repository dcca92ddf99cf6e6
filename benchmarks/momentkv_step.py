"""MomentKV's correction: the cost of one decode step's attention with and without the moments (issue: MomentKV).

    .venv/bin/python benchmarks/momentkv_step.py --entries 128 512 2048 --threads 1

One layer with SmolLM2's shapes (3 KV heads, 9 query heads, d = 64), one decode query, the
real read path (``attention.read``). Rows: entries held; the plain read (SDPA fast path, what
eviction methods use); the reference read without a summary (float32, log-sum-exp: the path a
layer with votes or moments takes); the same with MomentKV's moments merged. Ratios are within
one run; the whole-model decode ratio is in ``kvcompress bench``.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kvcompress.attention import attend_reference, group_queries, read
from kvcompress.cache import LayerCache
from kvcompress.methods.momentkv import Moments


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
    module = SimpleNamespace(num_key_value_groups=g, training=False, is_causal=True, attention_dropout=0.0)
    print("| entries | plain read (SDPA) µs | reference read µs | + moments µs | moments ÷ reference | moments ÷ SDPA |")
    print("|---|---|---|---|---|---|")
    for n in args.entries:
        layer = LayerCache(0, h, d)
        layer.append(torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen), torch.arange(n)[None])
        evicted = torch.randn(1, h, 4 * n, d, generator=gen)
        moments = Moments.empty(1, h, d, "cpu").add(evicted, torch.randn(1, h, 4 * n, d, generator=gen), torch.ones(1, h, 4 * n, dtype=torch.bool))
        query = torch.randn(1, h * g, 1, d, generator=gen)
        position = torch.tensor([[5 * n]])
        view = layer.padded_view()
        grouped = group_queries(query, h)

        def reference(summary=None):
            return attend_reference(grouped, view.keys, view.values, d**-0.5, query_positions=position,
                                    key_positions=view.positions, summary=summary)

        with torch.inference_mode():
            plain = timed(lambda: read(module, layer, query, position, d**-0.5), args.repeats)
            ref = timed(reference, args.repeats)
            corrected = timed(lambda: reference(moments), args.repeats)
        print(f"| {n} | {plain * 1e6:.0f} | {ref * 1e6:.0f} | {corrected * 1e6:.0f} | {corrected / ref:.2f} | {corrected / plain:.2f} |")


if __name__ == "__main__":
    main()
