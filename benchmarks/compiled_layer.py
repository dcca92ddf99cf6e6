"""A decoding step with its layers as one compiled call each (``_Layer.compiled``) against the Python layers, in one run.

    .venv/bin/python benchmarks/compiled_layer.py [--methods full,snapkv:ratio=0.1,kivi:bits=2] [--out runs/compiled_layer.json]

The engine of ``benchmarks/vs_vllm.py`` (the embedded SmolLM2 in float32, ``--prompts`` distinct passages of
``--prompt-tokens`` token ids, a 1 GiB pool, 2 threads) decodes its requests step by step once every prompt has its first
token; the steps alternate between the compiled layers and the Python ones (the same numbers bit for bit:
tests/engine/test_decode_layer.py), so both meet the same machine load. Reports each form's median step in ms and their
ratio, per method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench import cpu_description
from kvcompress.methods import split_method_list
from vs_vllm import prompt_ids


def step_times(llm, ids: list[list[int]], method: str, steps: int) -> dict:
    """Median decoding step (ms) with the layers compiled and in Python, steps alternating."""
    params = kvc.SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    requests = [llm.add_request(prompt, params, method=method) for prompt in ids]
    while not all(llm.request(r).output_ids for r in requests):
        llm.step()
    layers = llm.runner.decoder.layers
    compiled = [layer.compiled for layer in layers]
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for step in range(steps):
            on = step % 2 == 0
            for layer, kept in zip(layers, compiled):
                layer.compiled = kept if on else None
            start = time.perf_counter()
            llm.step()
            times[on].append(time.perf_counter() - start)
    finally:
        for layer, kept in zip(layers, compiled):
            layer.compiled = kept
    for r in requests:
        llm.abort(r)
    while llm.has_unfinished():
        llm.step()
    ms = {on: 1000 * statistics.median(t) for on, t in times.items()}
    return {"method": method, "compiled_ms": ms[True], "python_ms": ms[False], "ratio": ms[False] / ms[True],
            "compiled_layers": sum(c is not None for c in compiled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="full,snapkv:ratio=0.1,kivi:bits=2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=60, help="decoding steps timed per method (half in each form)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/compiled_layer.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = kvc.LLM(kv_memory="1GiB", max_num_seqs=args.prompts, max_num_batched_tokens=2048)
    ids = prompt_ids(llm.tokenizer, args.prompts, args.prompt_tokens)
    rows = [step_times(llm, ids, method, args.steps) for method in split_method_list(args.methods)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "args": vars(args), "cpu": cpu_description()}, indent=1, default=str))
    print("| method | compiled layers ms a step | Python layers ms a step | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['compiled_ms']:.1f} | {r['python_ms']:.1f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
