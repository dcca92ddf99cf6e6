"""The model's linear products on the CPU: transformers' ``F.linear`` against oneDNN over packed weights.

    .venv/bin/python benchmarks/linears.py --out runs/linears.json

For each distinct linear shape of the model (the embedded SmolLM2-135M-Instruct by default), at the rows a
decoding step (1, 8, 32 requests) and a prompt (512 tokens) give, in float32 and bfloat16: the best of
``--repeats`` timings of ``F.linear`` and of ``engine/packed.py``'s forward (oneDNN over the packed copy; over a step's
few rows, the compiled ``linear_rows`` where ``streamed_dtypes`` has the dtype), the same thread count, one run; and
the step's total (every layer's products plus the output layer) in each form. One layer timed again and again reads its
weight from the caches; ``--step`` times instead a whole step's products over every layer's own weights (as a decoding
step reads them: from memory), ``F.linear`` and oneDNN's packed products against ``linear_rows``, at rows 1, 4, 8, 12,
16, 24.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcompress.engine.packed import PackedLinear, packs
from kvcompress.kernels import cpu_kernels
from kvcompress.bench import cpu_description
from kvcompress.models import load_model


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--step", action="store_true", help="a whole step's products over every layer's own weights")
    parser.add_argument("--out", default="runs/linears.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=torch.float32)
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    if args.step:
        return step_products(shapes, args)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in map(int, args.rows.split(",")):
            total_plain = total_packed = 0.0
            for (out_features, in_features), count in shapes.items():
                layer = torch.nn.Linear(in_features, out_features, bias=False).to(dtype)
                packed = PackedLinear([layer.weight], layer.bias)
                x = torch.randn(rows, in_features).to(dtype)
                with torch.no_grad():
                    plain_ms = best_ms(lambda: F.linear(x, layer.weight), args.repeats)
                    packed_ms = best_ms(lambda: packed(x), args.repeats)
                total_plain, total_packed = total_plain + count * plain_ms, total_packed + count * packed_ms
                results.append(dict(dtype=str(dtype).removeprefix("torch."), rows=rows, shape=[out_features, in_features], layers=count,
                                    f_linear_ms=round(plain_ms, 4), packed_ms=round(packed_ms, 4), speedup=round(plain_ms / packed_ms, 2)))
                print(f"{results[-1]['dtype']:>8} rows {rows:>4} {out_features:>6}×{in_features:<5} ×{count:<3} F.linear {plain_ms:8.3f} ms  "
                      f"packed {packed_ms:8.3f} ms  {plain_ms / packed_ms:4.2f}×", flush=True)
            results.append(dict(dtype=str(dtype).removeprefix("torch."), rows=rows, shape="every linear of a forward",
                                f_linear_ms=round(total_plain, 3), packed_ms=round(total_packed, 3), speedup=round(total_plain / total_packed, 2)))
            print(f"{'':>8} rows {rows:>4} every linear: F.linear {total_plain:.2f} ms, packed {total_packed:.2f} ms "
                  f"({total_plain / total_packed:.2f}×)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(threads=args.threads, repeats=args.repeats, results=results), indent=1))


def step_products(shapes: Counter, args) -> None:
    """A step's products over every layer's own weights (distinct tensors, so they stream from memory): ``F.linear``
    (transformers' own, what ``generate`` and ``bench`` run) and oneDNN's packed products against ``linear_rows``, in each
    dtype each runs here; ms and the weights' GB/s."""
    kernels = cpu_kernels()
    runs = set() if kernels is None else set(kernels.linear_rows_dtypes())
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        weights = [torch.randn(*shape).to(dtype) for shape, count in shapes.items() for _ in range(count)]
        total = sum(w.numel() * w.element_size() for w in weights)
        packed = [PackedLinear([w], None) for w in weights] if packs(dtype) else None
        for rows in (1, 4, 8, 12, 16, 24):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in weights}
            forms = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}  # transformers' own (the hf path's)
            if packed is not None:
                forms["oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[p.own[0].shape[1]], p.weight, None, "none", [], "")
                                           for p in packed]
            if name in runs:
                forms["linear_rows"] = lambda: [kernels.linear_rows(xs[w.shape[1]], [w], None) for w in weights]
            timed = {form: best_ms(fn, args.repeats) for form, fn in forms.items()}
            results.append(dict(dtype=name, rows=rows, weight_bytes=total, **{f"{form}_ms": round(ms, 2) for form, ms in timed.items()}))
            print(f"{name:>8} rows {rows:>3}: " + " | ".join(f"{form} {ms:6.1f} ms ({total / ms / 1e6:5.1f} GB/s)" for form, ms in timed.items()),
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(threads=args.threads, repeats=args.repeats, cpu=cpu_description(), results=results), indent=1))


if __name__ == "__main__":
    main()
