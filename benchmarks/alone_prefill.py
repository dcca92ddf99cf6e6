"""Prompts the engine prefills alone (KVzip's replay, GVote's statistics): wall time and prefill rate, with the
engine's packed weight copies' bytes.

    python benchmarks/alone_prefill.py float32|bfloat16 >> runs/packed_once/after.jsonl

Two prompts of 2000 tokens from the shipped haystack, 4 new tokens each, greedy; each method twice on one engine,
the faster run kept. Prints one JSON line: the dtype, ``packed_weight_bytes`` and, per method, the wall time,
the prefill tokens/s and the answers (to check that a change kept them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.engine.sampling import SamplingParams

HAYSTACK = Path(kvc.__file__).parent / "data" / "haystack.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dtype", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = kvc.LLM(kv_memory="1GiB", dtype=args.dtype)
    ids = llm.tokenizer(HAYSTACK.read_text())["input_ids"]
    prompts = [ids[i * 50 : i * 50 + 2000] for i in range(2)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    report = {"dtype": args.dtype, "packed_weight_bytes": llm.packed_weight_bytes}
    for method in ("kvzip:ratio=0.25", "gvote"):
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, method=method)
            runs.append((time.perf_counter() - start, llm.stats()["prefill_tokens_per_s"], [o.token_ids for o in outs]))
        wall, rate, answers = min(runs, key=lambda run: run[0])
        report[method] = {"wall_s": round(wall, 2), "prefill_tok_s": round(rate, 1), "answers": answers}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
