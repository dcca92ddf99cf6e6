"""The paged decode read's bandwidth on a CUDA GPU, against the GPU's own measured copy bandwidth.

    python benchmarks/gpu_kernels.py [--out runs/gpu_kernels.json] [--kinds plain,kivi2] [--sweep kivi2:llama-3.1-8b:8:32768]

Model shapes of real sizes (random entries: no weights are needed): Llama-3.1-8B (32 query heads, 8 KV heads,
head_dim 128) and Qwen2.5-7B (28 query heads, 4 KV heads), 8k–32k entries per head, 1–32 rows, bfloat16 pools.
Each row's entries lie in the pool in runs of 16 slots, the runs in random order (how a pool that has served for a
while hands slots out). Cases: every entry plain; half the entries holes (a selection left them out); per-entry
log-weights; every entry but the last 128 coded as 2-bit KIVI (each head's blocks of 32 anywhere in the tier, a block's
entries in order in the head's columns, as the engine codes them: the kernel reads each block whole); the same with
each block's first two columns swapped ("kivi2-swapped": the kernel reads those entry by entry).

Bytes counted (the fewest a read must move): for each entry, its slot (4 bytes), its log-weight where it has one
(4), and its key and value where it is plain (2·d·2 bytes) or its codes, zero points and scales where it is coded;
the query and the output. Nothing else (the split partials, the stacked tables) is counted, so the figure is the
useful bandwidth. The peak is a device-to-device copy of 4 GiB measured in the same run (bytes read + written).

Times are medians of ``triton.testing.do_bench`` (CUDA events), eager (one launch after another, as the engine
calls it) and replayed from a CUDA graph (the kernels alone, no launch gaps). Each case is also checked against the
plain-PyTorch float32 read (``paged_decode_torch``) on the same entries. ``--sweep`` then times every launch
shape (``Tuning``) on the cases it names. Prints a table; writes every figure to ``--out`` as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch
import triton
import triton.testing

from kvcompress.read.paged import paged_decode_torch
from kvcompress.read.paged_triton import TUNING, Tuning, kivi_tuning, multiprocessor_count, paged_decode_triton, split_size
from kvcompress.store.codecs import KiviCodec
from kvcompress.store.slots import TIER_SHIFT
from kvcompress.store.view import KiviBlocks

SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
RUN = 16  # slots handed out in runs of this many
KIVI_TIER, RECENT = 1, 128
KINDS = ("plain", "holes", "weighted", "kivi2", "kivi2-swapped")
KIVI = kivi_tuning(32)  # the launch shape for the cases' KIVI blocks of 32


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (the ceiling a memory-bound read meets)."""
    source = torch.randn(2**30, device=device)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=50, rep=300, return_mode="median")
    return 2 * 4 * 2**30 / (ms * 1e-3)


def make_case(shape: str, rows: int, context: int, kind: str, device: torch.device, seed: int = 0):
    """(query, keys, values, tables, lengths, log_weights, kivi, bytes): a pool of random bfloat16 entries, each row's
    heads ``context`` entries long, laid out as ``kind`` asks."""
    hq, heads, dim = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed)
    entries = rows * heads * context
    runs = torch.randperm(entries // RUN, generator=gen, device=device)  # run r holds slots 1 + r·RUN ...
    slots = (1 + runs[:, None] * RUN + torch.arange(RUN, device=device)).reshape(rows, heads, context).int()
    keys = torch.randn(entries + 1, dim, generator=gen, device=device, dtype=torch.bfloat16)
    values = torch.randn(entries + 1, dim, generator=gen, device=device, dtype=torch.bfloat16)
    query = torch.randn(rows, hq, dim, generator=gen, device=device, dtype=torch.bfloat16)
    log_weights, kivi = None, None
    entry_bytes = torch.full((rows, heads, context), 4 + 2 * dim * 2, device=device, dtype=torch.float64)
    if kind == "holes":
        hole = torch.rand(rows, heads, context, generator=gen, device=device) < 0.5
        slots = slots.masked_fill(hole, 0)
        entry_bytes[hole] = 4
    elif kind == "weighted":
        log_weights = [w for w in -torch.rand(rows, heads, context, generator=gen, device=device)]
        entry_bytes += 4
    elif kind in ("kivi2", "kivi2-swapped"):
        codec = KiviCodec(bits=2, group_size=32, param_dtype=torch.bfloat16)
        coded = context - RECENT
        blocks = rows * heads * coded // codec.block_size
        arrays = codec.encode(torch.randn(blocks, codec.block_size, dim, generator=gen, device=device).to(torch.bfloat16),
                              torch.randn(blocks, codec.block_size, dim, generator=gen, device=device).to(torch.bfloat16))
        arrays = {name: torch.cat([torch.zeros_like(a[:1]), a]) for name, a in arrays.items()}  # block 0 unused, as in the pool
        kivi = KiviBlocks(KIVI_TIER, codec, arrays)
        order = 1 + torch.randperm(blocks, generator=gen, device=device)  # a head's blocks anywhere in the tier; its entries in order
        ids = order[:, None] * codec.block_size + torch.arange(codec.block_size, device=device)
        if kind == "kivi2-swapped":
            ids[:, [0, 1]] = ids[:, [1, 0]]
        slots[..., :coded] = ((KIVI_TIER << TIER_SHIFT) | ids.reshape(rows, heads, coded)).int()
        per_block = sum(a[1:].numel() * a.element_size() for a in arrays.values()) / blocks
        entry_bytes[..., :coded] = 4 + per_block / codec.block_size
    elif kind != "plain":
        raise ValueError(kind)
    tables = list(slots)
    lengths = torch.full((rows, heads), context, dtype=torch.long, device=device)
    moved = float(entry_bytes.sum()) + 2 * query.numel() * query.element_size()
    return query, keys, values, tables, lengths, log_weights, kivi, moved


def time_read(case, tuning: Tuning | None) -> dict:
    query, keys, values, tables, lengths, log_weights, kivi, moved = case
    scaling = 1 / math.sqrt(query.shape[-1])
    longest = tables[0].shape[1]
    call = lambda: paged_decode_triton(query, keys, values, tables, lengths, log_weights, scaling, kivi, longest=longest, tuning=tuning)  # noqa: E731
    eager = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    graph = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
    return {"eager_ms": eager, "graph_ms": graph, "bytes": moved, "eager_GBps": moved / eager / 1e6, "graph_GBps": moved / graph / 1e6}


def error_against_reference(case, tuning: Tuning | None) -> float:
    """‖out − ref‖ / ‖ref‖ against the float32 PyTorch read, on the first row's first two heads' first 4096 entries."""
    query, keys, values, tables, lengths, log_weights, kivi, _ = case
    heads, hq = lengths.shape[1], query.shape[1]
    small = [tables[0][:2, :4096]]
    weights = None if log_weights is None else [log_weights[0][:2, :4096]]
    small_lengths = torch.full((1, 2), min(4096, tables[0].shape[1]), dtype=torch.long, device=query.device)
    q = query[:1, : 2 * hq // heads]
    scaling = 1 / math.sqrt(query.shape[-1])
    out, _ = paged_decode_triton(q, keys, values, small, small_lengths, weights, scaling, kivi, tuning=tuning)
    ref, _ = paged_decode_torch(q.float(), keys, values, small, small_lengths, weights, scaling, kivi)
    return float((out.float() - ref).norm() / ref.norm())


def dense_sdpa(shape: str, rows: int, context: int, device: torch.device) -> dict:
    """PyTorch's own SDPA over a dense contiguous bfloat16 cache of the same size (what a dense engine reads)."""
    hq, heads, dim = SHAPES[shape]
    q = torch.randn(rows, hq, 1, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(rows, heads, context, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    moved = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return {"sdpa_ms": ms, "sdpa_GBps": moved / ms / 1e6}


def sweep(device: torch.device, kind: str, shape: str, rows: int, context: int) -> list[dict]:
    """Every launch shape (blocks of 32–128 entries, 4 or 8 warps, 1 or 2 stages) on one case, each checked against
    the reference."""
    case = make_case(shape, rows, context, kind, device)
    results = []
    for block in (32, 64, 128):
        for warps in (4, 8):
            for stages in (1, 2):
                tuning = Tuning(block=block, warps=warps, stages=stages)
                try:
                    timing = {**time_read(case, tuning), "rel_error": error_against_reference(case, tuning)}
                except Exception as error:  # a shape that does not fit (registers, shared memory)
                    timing = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                results.append({"kind": kind, "shape": shape, "rows": rows, "context": context, **dataclasses.asdict(tuning), **timing})
                print("sweep", json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_kernels.json"))
    parser.add_argument("--sweep", default="", help="then time every launch shape on these cases (kind:shape:rows:context, comma-separated)")
    parser.add_argument("--contexts", default="8192,16384,32768")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--tuning", default=None, help="block,warps,stages of the split kernel (default: the module's TUNING, KIVI_TUNING for coded entries)")
    args = parser.parse_args()
    tuning = None if args.tuning is None else Tuning(*map(int, args.tuning.split(",")))
    device = torch.device("cuda")
    peak = copy_bandwidth(device)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "copy_GBps": peak / 1e9, "tuning": dataclasses.asdict(tuning) if tuning else {"plain": dataclasses.asdict(TUNING), "kivi": dataclasses.asdict(KIVI)}, "cases": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{report['device']}: device-to-device copy {peak / 1e9:.0f} GB/s", flush=True)
    for shape in SHAPES:
        for context in map(int, args.contexts.split(",")):
            for rows in map(int, args.rows.split(",")):
                if rows * context > 32 * 32768:
                    continue
                for kind in filter(None, args.kinds.split(",")):
                    case = make_case(shape, rows, context, kind, device)
                    row = {"shape": shape, "rows": rows, "context": context, "kind": kind,
                           "split": split_size(rows * SHAPES[shape][1], context, multiprocessor_count(device), tuning or (KIVI if kind.startswith("kivi") else TUNING)), **time_read(case, tuning),
                           "rel_error": error_against_reference(case, tuning)}
                    if kind == "plain":
                        row.update(dense_sdpa(shape, rows, context, device))
                    row["graph_of_peak"] = row["graph_GBps"] * 1e9 / peak
                    report["cases"].append(row)
                    print(json.dumps(row), flush=True)
                    args.out.write_text(json.dumps(report, indent=1))
                    del case
                    torch.cuda.empty_cache()
    print(f"\npeak (copy) {peak / 1e9:.0f} GB/s; tuning {tuning}")
    print(f"{'shape':14} {'rows':>4} {'ctx':>6} {'kind':9} {'eager ms':>9} {'graph ms':>9} {'GB/s':>7} {'of peak':>7} {'sdpa GB/s':>9} {'rel err':>8}")
    for r in report["cases"]:
        sdpa = f"{r['sdpa_GBps']:9.0f}" if "sdpa_GBps" in r else " " * 9
        print(f"{r['shape']:14} {r['rows']:4} {r['context']:6} {r['kind']:9} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} "
              f"{r['graph_GBps']:7.0f} {r['graph_of_peak']:7.0%} {sdpa} {r['rel_error']:8.1e}")
    report["sweep"] = []
    for spec in filter(None, args.sweep.split(",")):
        kind, shape, rows, context = spec.split(":")
        report["sweep"] += sweep(device, kind, shape, int(rows), int(context))
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{'kind':9} {'shape':14} {'rows':>4} {'ctx':>6} {'block':>5} {'warps':>5} {'stages':>6} {'graph ms':>9} {'GB/s':>7} {'rel err':>8}")
    for r in report["sweep"]:
        timing = f"{r['graph_ms']:9.3f} {r['graph_GBps']:7.0f} {r['rel_error']:8.1e}" if "graph_ms" in r else r["error"][:60]
        print(f"{r['kind']:9} {r['shape']:14} {r['rows']:4} {r['context']:6} {r['block']:5} {r['warps']:5} {r['stages']:6} {timing}")


if __name__ == "__main__":
    main()
