"""Soak the OpenAI-compatible server: a few hundred mixed requests, a fifth of them bad, some clients hanging up.

    .venv/bin/python benchmarks/serve_soak.py --requests 300 --concurrency 8 --max-seconds 300

A server is started on loopback (``kvcompress serve`` in a subprocess, on the embedded
SmolLM2-135M-Instruct unless ``--model`` names another) and ``--concurrency`` client threads send
``--requests`` requests between them, stopping early after ``--max-seconds``. The requests, drawn
once from ``--seed``: completions and chat completions, a third of them streamed; prompts of 300
to 1,500 tokens of the project's filler prose; ``max_tokens`` 8 to 32; ``kv_compression`` mixed
(the server's default, full, SnapKV 0.25, Ada-KV 0.25, StreamingLLM budget 128, KIVI, Quest 0.25).
About a fifth are bad and must be refused with a 4xx: malformed JSON, a raw ``NaN`` temperature,
an unknown field, bad ``kv_compression`` specs, a prompt over the server's limit, a lone
surrogate, ``max_tokens`` over the limit, another model's name, unknown routes. Some streamed
clients close the connection after the first chunk.

Reported: completed (2xx, whole answers), refused (4xx), dropped (hung up on purpose), failed
(5xx, a server error event in a stream, a transport error, or no answer within ``--timeout``
seconds), bad requests that were not refused, p50/p99 latency of completed requests and
time to first token of streamed ones, the server's pool and running/waiting gauges after the load
drained (the pool must be 0), and the wall time. On two shared CPU cores about 20 requests a
minute get through, so ``--max-seconds`` ends the default run after ~100 requests; give it more
time, or ``--device cuda``, to send them all. A markdown table is printed and JSON written to
``--out`` (the server's log next to it); the exit status is 1 if any request failed or the pool
is not empty after.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvcompress.serve import wait_healthy

KV_MIX = [None, {"method": "full"}, {"method": "snapkv", "ratio": 0.25}, {"method": "adakv", "ratio": 0.25},
          {"method": "streamingllm", "budget": 128}, {"method": "kivi"}, {"method": "quest", "ratio": 0.25}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Planned:
    """One request of the soak: what is sent and what should come back."""

    index: int
    kind: str  # good, drop (a stream the client hangs up on) or bad
    label: str  # what it is: "chat stream snapkv" or "bad: NaN temperature"
    method: str
    path: str
    body: bytes
    stream: bool = False


@dataclass
class Result:
    index: int
    kind: str
    label: str
    outcome: str  # completed, refused, dropped or failed
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class Tally:
    results: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, result: Result) -> None:
        with self.lock:
            self.results.append(result)


def passage(words: list[str], rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the filler prose from a random place (0.75 words a token, as serve_load)."""
    size = int(tokens * 0.75)
    start = rng.randrange(0, len(words) - size)
    return " ".join(words[start:start + size])


def plan(args, model: str) -> list[Planned]:
    """The soak's requests, drawn from ``args.seed``: good ones (some streamed, some dropped) and bad ones."""
    from kvcompress.demo import haystack_text

    rng = random.Random(args.seed)
    words = haystack_text().split()
    too_long = " ".join(words[: int((args.max_prompt_tokens + 600) * 0.75)])
    bad = [
        ("bad: malformed JSON", "POST", "/v1/completions", b'{"model": "%s", "prompt": "Hello' % model.encode()),
        ("bad: NaN temperature", "POST", "/v1/completions", b'{"model": "%s", "prompt": "Hello", "temperature": NaN}' % model.encode()),
        ("bad: unknown field", "POST", "/v1/chat/completions",
         json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "frobnicate": 1}).encode()),
        ("bad: unknown method", "POST", "/v1/completions",
         json.dumps({"model": model, "prompt": "Hello", "kv_compression": {"method": "nope", "ratio": 0.5}}).encode()),
        ("bad: ratio 1.5", "POST", "/v1/completions",
         json.dumps({"model": model, "prompt": "Hello", "kv_compression": {"method": "snapkv", "ratio": 1.5}}).encode()),
        ("bad: no size", "POST", "/v1/chat/completions",
         json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "kv_compression": {"method": "snapkv"}}).encode()),
        ("bad: budget 0", "POST", "/v1/completions",
         json.dumps({"model": model, "prompt": "Hello", "kv_compression": {"method": "adakv", "budget": 0}}).encode()),
        ("bad: unknown option", "POST", "/v1/completions",
         json.dumps({"model": model, "prompt": "Hello", "kv_compression": {"method": "snapkv", "windw": 8, "ratio": 0.5}}).encode()),
        ("bad: prompt too long", "POST", "/v1/completions", json.dumps({"model": model, "prompt": too_long, "max_tokens": 8}).encode()),
        ("bad: lone surrogate", "POST", "/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % model.encode()),
        ("bad: max_tokens over the limit", "POST", "/v1/completions",
         json.dumps({"model": model, "prompt": "Hello", "max_tokens": args.max_tokens_limit + 1}).encode()),
        ("bad: another model", "POST", "/v1/chat/completions",
         json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}).encode()),
        ("bad: unknown route", "POST", "/v1/nothing", json.dumps({"model": model, "prompt": "Hello"}).encode()),
        ("bad: unknown route", "GET", "/v2/models", b""),
    ]
    planned = []
    for i in range(args.requests):
        draw = rng.random()
        if draw < args.bad_fraction:  # the bad kinds in turn, so that each is sent
            label, method, path, body = bad[sum(p.kind == "bad" for p in planned) % len(bad)]
            planned.append(Planned(i, "bad", label, method, path, body))
            continue
        dropped = draw < args.bad_fraction + args.drop_fraction
        stream = dropped or rng.random() < 1 / 3
        chat = rng.random() < 0.5
        kv = KV_MIX[rng.randrange(len(KV_MIX))]
        text = passage(words, rng, rng.randint(300, 1500))
        body = {"model": model, "max_tokens": rng.randint(8, 32), "temperature": rng.choice([0.0, 0.7]), "stream": stream}
        if dropped:
            body["max_tokens"] = 32  # long enough to be mid-answer when the client hangs up
        if chat:
            body["messages"] = [{"role": "user", "content": text + "\n\nIn one sentence, what is this passage about?"}]
        else:
            body["prompt"] = text + "\n\nIn one sentence, this passage is about"
        if kv is not None:
            body["kv_compression"] = kv
        label = f"{'chat' if chat else 'completions'}{' stream' if stream else ''} {kv['method'] if kv else 'default'}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        planned.append(Planned(i, "drop" if dropped else "good", label, "POST", path, json.dumps(body).encode(), stream))
    return planned


def send(client: httpx.Client, item: Planned, timeout: float) -> Result:
    """Send one planned request and classify its answer."""
    result = Result(item.index, item.kind, item.label, "failed")
    start = time.perf_counter()
    headers = {"content-type": "application/json"} if item.body else {}
    try:
        with client.stream(item.method, item.path, content=item.body or None, headers=headers) as response:
            result.status = response.status_code
            if not item.stream or response.status_code != 200:
                text = response.read().decode("utf-8", "replace")
                result.latency_s = time.perf_counter() - start
                return classify(result, response, text)
            events = []
            for line in response.iter_lines():
                if time.perf_counter() - start > timeout:
                    result.detail = f"the stream did not end within {timeout} s"
                    return result
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                events.append(payload)
                if payload != "[DONE]" and result.ttft_s is None and '"error"' not in payload:
                    chunk = json.loads(payload)
                    choice = (chunk.get("choices") or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        result.ttft_s = time.perf_counter() - start
                        if item.kind == "drop":  # hang up mid-answer
                            result.outcome, result.latency_s = "dropped", None
                            return result
            result.latency_s = time.perf_counter() - start
            return classify_stream(result, events)
    except httpx.TimeoutException:
        result.detail = f"no answer within {timeout} s"
    except httpx.HTTPError as error:
        result.detail = f"{type(error).__name__}: {error}"
    return result


def classify(result: Result, response: httpx.Response, text: str) -> Result:
    status = response.status_code
    if status >= 500:
        result.detail = text[:300]
        return result
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        result.detail = f"{status} not JSON: {text[:200]}"
        return result
    if 400 <= status < 500:
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)):
            result.detail = f"{status} not an OpenAI error: {text[:200]}"
            return result
        result.outcome, result.detail = "refused", error["message"][:200]
        return result
    if status == 200 and isinstance(body, dict) and body.get("choices"):
        result.outcome = "completed"
        return result
    result.detail = f"{status}: {text[:200]}"
    return result


def classify_stream(result: Result, events: list[str]) -> Result:
    if not events or events[-1] != "[DONE]":
        result.detail = f"the stream ended without [DONE] ({len(events)} events)"
        return result
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e and "error" in json.loads(e)]
    if any(error.get("type") == "server_error" for error in errors):
        result.detail = "server error event: " + errors[0].get("message", "")[:200]
        return result
    if errors:
        result.outcome, result.detail = "refused", errors[0].get("message", "")[:200]
        return result
    result.outcome = "completed"
    return result


def gauges(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvcompress_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run(args) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "kvcompress.cli", "serve", "--port", str(port), "--kv-memory", args.kv_memory,
               "--max-prompt-tokens", str(args.max_prompt_tokens), "--max-tokens-limit", str(args.max_tokens_limit), "--quiet"]
    if args.model:
        command += ["--model", args.model]
    if args.device:
        command += ["--device", args.device]
    log_path = args.out.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(url, server, timeout_s=300)
            except RuntimeError as error:
                raise RuntimeError(f"{error}; see {log_path}") from None
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            planned = plan(args, model)
            todo: queue.Queue[Planned] = queue.Queue()
            for item in planned:
                todo.put(item)
            tally = Tally()
            start = time.perf_counter()

            def client_thread() -> None:
                with httpx.Client(base_url=url, timeout=httpx.Timeout(args.timeout)) as client:
                    while time.perf_counter() - start < args.max_seconds:
                        try:
                            item = todo.get_nowait()
                        except queue.Empty:
                            return
                        tally.add(send(client, item, args.timeout))

            threads = [threading.Thread(target=client_thread) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            load_s = time.perf_counter() - start
            drained_by = time.time() + 60  # dropped streams and aborts finish asynchronously
            while True:
                after = gauges(url)
                idle = after.get("kvcompress_requests_running", 1) == 0 and after.get("kvcompress_requests_waiting", 1) == 0
                if (idle and after.get("kvcompress_kv_pool_used_bytes", 1) == 0) or time.time() > drained_by:
                    break
                time.sleep(0.5)
            healthy = httpx.get(url + "/health", timeout=10).status_code == 200
            wall_s = time.perf_counter() - start
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    results = sorted(tally.results, key=lambda r: r.index)
    count = lambda outcome: sum(r.outcome == outcome for r in results)  # noqa: E731
    completed = [r for r in results if r.outcome == "completed"]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None and r.kind == "good"]
    return {
        "model": model, "requests": args.requests, "sent": len(results), "not_sent": args.requests - len(results),
        "concurrency": args.concurrency, "completed": count("completed"), "refused": count("refused"),
        "dropped": count("dropped"), "failed": count("failed"),
        "bad_sent": sum(r.kind == "bad" for r in results),
        "bad_not_refused": [asdict(r) for r in results if r.kind == "bad" and r.outcome != "refused"],
        "good_refused": [asdict(r) for r in results if r.kind != "bad" and r.outcome == "refused"],
        "failures": [asdict(r) for r in results if r.outcome == "failed"],
        "latency_s_p50": percentile([r.latency_s for r in completed], 0.5),
        "latency_s_p99": percentile([r.latency_s for r in completed], 0.99),
        "ttft_s_p50": percentile(ttft, 0.5), "ttft_s_p99": percentile(ttft, 0.99),
        "pool_used_bytes_after": after.get("kvcompress_kv_pool_used_bytes"),
        "requests_running_after": after.get("kvcompress_requests_running"),
        "requests_waiting_after": after.get("kvcompress_requests_waiting"),
        "engine_errors": after.get("kvcompress_engine_errors"), "healthy_after": healthy,
        "load_s": load_s, "wall_s": wall_s, "log": str(log_path),
        "by_label": {label: {o: sum(r.outcome == o for r in results if r.label == label) for o in ("completed", "refused", "dropped", "failed")}
                     for label in sorted({r.label for r in results})},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the server's --model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=300, help="stop sending new requests after this long")
    parser.add_argument("--timeout", type=float, default=180, help="a request unanswered this long counts as a hang")
    parser.add_argument("--bad-fraction", type=float, default=0.2)
    parser.add_argument("--drop-fraction", type=float, default=0.05, help="requests whose client hangs up mid-stream")
    parser.add_argument("--max-prompt-tokens", type=int, default=2048, help="the server's limit (a longer prompt is a bad request)")
    parser.add_argument("--max-tokens-limit", type=int, default=64, help="the server's largest max_tokens")
    parser.add_argument("--kv-memory", default="512MiB")
    parser.add_argument("--device", default=None, help="the server's --device (default: cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/serve_soak.json"))
    args = parser.parse_args()
    row = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1))
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    whole = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
    print("| requests sent | completed | refused (4xx) | dropped on purpose | failed | bad not refused | latency s p50 / p99 "
          "| streamed TTFT s p50 / p99 | pool used after | running after | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {row['sent']} of {row['requests']} ({row['bad_sent']} bad) | {row['completed']} | {row['refused']} | {row['dropped']} | "
          f"{row['failed']} | {len(row['bad_not_refused'])} | {fmt(row['latency_s_p50'])} / {fmt(row['latency_s_p99'])} | "
          f"{fmt(row['ttft_s_p50'])} / {fmt(row['ttft_s_p99'])} | {whole(row['pool_used_bytes_after'])} | "
          f"{whole(row['requests_running_after'])} | {row['wall_s']:.0f} |")
    for name in ("failures", "bad_not_refused", "good_refused"):
        for r in row[name][:10]:
            print(f"{name}: #{r['index']} {r['label']} -> {r['status']} {r['detail']}")
    if row["failed"] or row["pool_used_bytes_after"] != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
