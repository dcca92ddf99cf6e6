"""The CPU paged read of KIVI-coded entries against the plain read of the same entries, one layer at 8000 tokens.

    .venv/bin/python benchmarks/kivi_read.py [--rounds 40] [--threads 2] [--out runs/kivi_read.json]

The engine's decoding read at ``kvcompress bench --engine --context-tokens 8000 --requests 4``: 4 rows, SmolLM2-135M's
heads (9 query heads, 3 KV heads, head_dim 64), every head's 8000 entries, the newest 128 plain and the rest 2- or 4-bit
KIVI blocks of 32 (float16 zero points and scales), against a float32 pool holding all 8000 plain. Two layouts:
"in order" (blocks and slots one after another, as the engine lays a prompt out) and "scattered" (blocks and slots
anywhere, as a pool that has served for a while may hold them). The cases are timed in turn, round after round, so
they meet the same machine load; each case's figure is its best round (the mean of 5 calls), in ms per layer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvcompress.bench import cpu_description
from kvcompress.read.paged import paged_decode
from kvcompress.store.codecs import KiviCodec
from kvcompress.store.slots import TIER_SHIFT
from kvcompress.store.view import KiviBlocks

ROWS, QUERY_HEADS, HEADS, DIM, CONTEXT, RECENT = 4, 9, 3, 64, 8000, 128


def cases(seed: int = 0) -> dict:
    """name → (query, keys, values, tables, lengths, KIVI tier or None)."""
    gen = torch.Generator().manual_seed(seed)
    entries = ROWS * HEADS * CONTEXT
    keys, values = (torch.randn(entries + 1, DIM, generator=gen) for _ in range(2))
    query = torch.randn(ROWS, QUERY_HEADS, DIM, generator=gen)
    lengths = torch.full((ROWS, HEADS), CONTEXT)
    in_order, scattered = 1 + torch.arange(entries), 1 + torch.randperm(entries, generator=gen)
    out = {f"plain, {name}": (query, keys, values, list(slots.view(ROWS, HEADS, CONTEXT).int()), lengths, None)
           for name, slots in (("in order", in_order), ("scattered", scattered))}
    coded = CONTEXT - RECENT
    for bits in (2, 4):
        codec = KiviCodec(bits=bits)
        blocks = ROWS * HEADS * coded // codec.block_size
        arrays = codec.encode(*(torch.randn(blocks, codec.block_size, DIM, generator=gen) for _ in range(2)))
        tier = KiviBlocks(1, codec, {name: torch.cat([torch.zeros_like(a[:1]), a]) for name, a in arrays.items()})
        for name, order, slots in (("in order", 1 + torch.arange(blocks), in_order),
                                   ("scattered", 1 + torch.randperm(blocks, generator=gen), scattered)):
            ids = (order[:, None] * codec.block_size + torch.arange(codec.block_size)).view(ROWS, HEADS, coded)
            table = slots.view(ROWS, HEADS, CONTEXT).int().clone()
            table[..., :coded] = ((1 << TIER_SHIFT) | ids).int()
            out[f"{bits}-bit KIVI, {name}"] = (query, keys, values, list(table), lengths, tier)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reads = cases()
    best = dict.fromkeys(reads, float("inf"))
    for _ in range(args.rounds):
        for name, (query, keys, values, tables, lengths, tier) in reads.items():
            paged_decode(query, keys, values, tables, lengths, None, DIM ** -0.5, tier)
            start = time.perf_counter()
            for _ in range(5):
                paged_decode(query, keys, values, tables, lengths, None, DIM ** -0.5, tier)
            best[name] = min(best[name], (time.perf_counter() - start) / 5 * 1000)
    print("| read | ms per layer (best round) | × plain in the same layout |\n|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} | {ms / best['plain, ' + name.split(', ')[1]]:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_description(), "threads": args.threads, "rounds": args.rounds,
                                        "ms_per_layer": best}, indent=1) + "\n")


if __name__ == "__main__":
    main()
