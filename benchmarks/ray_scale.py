"""Scale-out on Ray, measured: one engine against engine replicas on Ray Serve, and an eval sweep sharded over
Ray workers against one process, on the same CPUs.

    .venv/bin/python benchmarks/ray_scale.py --out runs/ray_scale.json

Serving: each setup is a ``kvcompress serve`` subprocess on loopback — ``one`` (one engine, this process's
threads, no Ray), ``ray-1x2`` (one replica of 2 threads behind Ray Serve's proxy and the router) and
``ray-2x1`` (two replicas of one thread each). For each: the latency of ``--sequential`` requests sent one
after another by one client (what Ray adds per request), then ``--clients`` streamed requests at once
(requests/s and generated tokens/s under load). Eval: the same grid with and without ``--ray --workers 2``;
its wall time is the run's own (results.json ``wall_s``, model loading excluded on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

from kvcompress.serve import wait_healthy
from serve_load import at_once, free_port, prompts  # benchmarks/, this script's folder

SETUPS = {"one": [], "ray-1x2": ["--replicas", "1", "--threads-per-replica", "2"],
          "ray-2x1": ["--replicas", "2", "--threads-per-replica", "1"]}


def serve(setup: str, args) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "kvcompress.cli", "serve", "--method", args.method, "--port", str(port),
               "--kv-memory", args.kv_memory, "--quiet", *SETUPS[setup]]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout_s=300)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        texts = prompts(max(args.clients, args.sequential), args.context_tokens)
        ask = lambda text, **kw: client.completions.create(model=model, prompt=text, temperature=0, **kw)  # noqa: E731
        ask(texts[0], max_tokens=2)  # warm
        latencies = []
        for text in texts[: args.sequential]:
            start = time.perf_counter()
            ask(text, max_tokens=args.sequential_tokens)
            latencies.append(time.perf_counter() - start)
        tokens, errors = [0] * args.clients, []

        def one(i: int) -> None:
            try:
                for chunk in ask(texts[i], max_tokens=args.max_tokens, stream=True, extra_body={"ignore_eos": True},
                                 stream_options={"include_usage": True}):
                    tokens[i] = chunk.usage.completion_tokens if chunk.usage else tokens[i]
            except Exception as error:  # noqa: BLE001 - counted
                errors.append(repr(error))

        wall = at_once(args.clients, one)
        return {"setup": setup, "latency_s_median": statistics.median(latencies), "latency_s_min": min(latencies),
                "clients": args.clients, "errors": len(errors), "load_wall_s": wall, "requests_per_s": (args.clients - len(errors)) / wall,
                "tokens_per_s": sum(tokens) / wall}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def evaluate(args) -> list[dict]:
    rows = []
    common = [sys.executable, "-m", "kvcompress.cli", "eval", "--methods", args.eval_methods, "--ratios", "0.25",
              "--samples", str(args.eval_samples), "--context-tokens", "1024", "--quiet", "--overwrite"]
    for name, extra in (("one process", []), ("--ray --workers 2", ["--ray", "--workers", "2"])):
        out = Path(args.scratch) / ("eval_" + ("ray" if extra else "one"))
        start = time.perf_counter()
        subprocess.run([*common, "--out", str(out), *extra], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        total = time.perf_counter() - start
        result = json.loads((out / "results.json").read_text())
        rows.append({"eval": name, "wall_s": result["wall_s"], "command_s": total, "runs": result["runs_total"],
                     "scores": {f"{r['method']}@{r['ratio']}": r["score"] for r in result["rows"] if r["task"] == "all"}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="full")
    parser.add_argument("--sequential", type=int, default=8, help="one-client requests, one after another")
    parser.add_argument("--sequential-tokens", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-memory", default="200MiB")
    parser.add_argument("--eval-methods", default="snapkv,kvzip,streamingllm")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per built-in task")
    parser.add_argument("--scratch", default="runs/ray_scale")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/ray_scale.json"))
    args = parser.parse_args()
    served = [serve(setup, args) for setup in SETUPS]
    evals = [] if args.skip_eval else evaluate(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"serve": served, "eval": evals, "args": vars(args)}, indent=1, default=str))
    print(f"| setup | 1-client latency s (median / min), {args.sequential_tokens} tokens | {args.clients} clients: requests/s "
          "| tokens/s | errors |")
    print("|---|---|---|---|---|")
    for r in served:
        print(f"| {r['setup']} | {r['latency_s_median']:.3f} / {r['latency_s_min']:.3f} | {r['requests_per_s']:.3f} | "
              f"{r['tokens_per_s']:.1f} | {r['errors']} |")
    if evals:
        print("\n| eval | runs | wall s | same scores |\n|---|---|---|---|")
        for r in evals:
            print(f"| {r['eval']} | {r['runs']} | {r['wall_s']:.0f} | {r['scores'] == evals[0]['scores']} |")


if __name__ == "__main__":
    main()
