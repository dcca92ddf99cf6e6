"""Load on the OpenAI-compatible server: requests/s and time to first token, per default method.

    .venv/bin/python benchmarks/serve_load.py --methods full,snapkv:ratio=0.25 --clients 24 --context-tokens 1000

For each method a server is started on loopback with it as the default (``kvcompress serve``
in a subprocess), ``--clients`` concurrent streamed chat completions (the official ``openai``
client) are sent at once, and we record the wall time, the time to each request's first
streamed token and to its last, and the server's pool gauge afterwards (0 when every
request released its slots).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from kvcompress.serve import wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int, tokens: int) -> list[str]:
    """Distinct passages of the project's filler prose, about ``tokens`` tokens each, with a question."""
    from kvcompress.demo import haystack_text

    words = haystack_text().split()
    size = int(tokens * 0.75)
    return [" ".join(words[(i * 97) % (len(words) - size):][:size]) + "\n\nIn one sentence, what is this passage about?"
            for i in range(count)]


def at_once(count: int, one) -> float:
    """Run ``one(i)`` for every i < ``count``, each in its own thread, all at once; the wall seconds until all end."""
    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def run(method: str, args) -> dict:
    name, *options = method.split(":")
    size = dict(option.split("=") for option in options)
    port = free_port()
    command = [sys.executable, "-m", "kvcompress.cli", "serve", "--method", name, "--port", str(port),
               "--kv-memory", args.kv_memory, "--quiet"]
    if "ratio" in size:
        command += ["--ratio", size["ratio"]]
    if "budget" in size:
        command += ["--budget", size["budget"]]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        texts = prompts(args.clients, args.context_tokens)
        results, errors = [None] * args.clients, []

        def one(i: int) -> None:
            start = time.perf_counter()
            first = None
            try:
                stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": texts[i]}],
                                                        max_tokens=args.max_tokens, temperature=0, stream=True)
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - start
                results[i] = (first, time.perf_counter() - start)
            except Exception as error:  # noqa: BLE001 - counted
                errors.append(repr(error))

        wall = at_once(args.clients, one)
        gauges = {line.split()[0]: float(line.split()[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                  if line.startswith("kvcompress_kv_pool") or line.startswith("kvcompress_requests_running")}
        done = [r for r in results if r is not None]
        ttft = sorted(r[0] for r in done if r[0] is not None)
        return {"method": method, "clients": args.clients, "completed": len(done), "errors": len(errors), "wall_s": wall,
                "requests_per_s": len(done) / wall, "ttft_s_median": statistics.median(ttft) if ttft else None,
                "ttft_s_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
                "latency_s_median": statistics.median(r[1] for r in done) if done else None, **gauges}
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="full,snapkv:ratio=0.25")
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-memory", default="200MiB")
    parser.add_argument("--out", type=Path, default=Path("runs/serve_load.json"))
    args = parser.parse_args()
    rows = [run(method, args) for method in args.methods.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("| default method | clients | completed | requests/s | TTFT s (median / p90) | latency s (median) | pool used after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['clients']} | {r['completed']} | {r['requests_per_s']:.3f} | {r['ttft_s_median']:.1f} / "
              f"{r['ttft_s_p90']:.1f} | {r['latency_s_median']:.1f} | {r.get('kvcompress_kv_pool_used_bytes', -1):.0f} |")


if __name__ == "__main__":
    main()
