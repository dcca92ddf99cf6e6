"""The OpenAI-compatible server on loopback: the official client, streaming, per-request compression,
bad input as 4xx JSON errors, disconnects, limits, metrics, a concurrent load test and SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from common import tiny_model
from conftest import tiny_tokenizer
import kvcompress as kvc
from kvcompress.serve import wait_healthy
from kvcompress.serve.app import build_app
from kvcompress.serve.protocol import Limits

MODEL_NAME = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1 {% endif %}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A uvicorn server in a thread (the engine's loop in its own)."""

    def __init__(self, method=None, kv_memory="8MiB", max_queued=64, limits=None):
        model = tiny_model(seed=7)
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)  # sharp logits: greedy answers do not depend on batching
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        self.llm = kvc.LLM(model_and_tokenizer=(model, tokenizer), kv_memory=kv_memory, max_num_seqs=16)
        self.app = build_app(self.llm, model_name=MODEL_NAME, method=method or kvc.get_method("snapkv", budget=24, window=8),
                             limits=limits or Limits(max_prompt_tokens=400, max_tokens=64), max_queued=max_queued, grace_s=2.0)
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server():
    srv = Server()
    yield srv
    srv.stop()


def words(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(2, 60, (n,), generator=gen))


def test_models_health_and_a_completion(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    out = server.client.completions.create(model=MODEL_NAME, prompt=words(50), max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    usage = out.usage.model_dump()
    assert usage["prompt_tokens"] == 50 and 0 < usage["kv_bytes"] < usage["kv_bytes_full"]  # the default method compressed it


def test_streamed_answers_equal_the_non_streamed_greedy_ones(server):
    for chat in (False, True):
        kwargs = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"kv_compression": {"method": "adakv", "ratio": 0.5}})
        if chat:
            kwargs["messages"] = [{"role": "user", "content": words(60, seed=1)}]
            whole = server.client.chat.completions.create(**kwargs).choices[0].message.content
            parts = [c.choices[0].delta.content or "" for c in server.client.chat.completions.create(stream=True, **kwargs) if c.choices]
        else:
            kwargs["prompt"] = words(60, seed=1)
            whole = server.client.completions.create(**kwargs).choices[0].text
            parts = [c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs) if c.choices]
        assert whole and "".join(parts) == whole


def test_stream_ends_with_done_and_can_report_usage(server):
    body = {"model": MODEL_NAME, "prompt": words(30), "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 5 and usage["kv_bytes_full"] > 0


BAD = [
    (b"{not json", 400, None),
    ({"prompt": "w1 w2"}, 400, "model"),
    ({"model": "other", "prompt": "w1"}, 404, "model"),
    ({"model": MODEL_NAME}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "nope", "ratio": 0.5}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "snapkv", "windw": 3, "ratio": 0.5}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "snapkv", "budget": 0}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "snapkv", "ratio": 1.5}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "quest", "ratio": 0.5, "page_size": "four"}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "deltakv"}}, 400, "kv_compression"),  # no codec shipped for this tiny model
    # no retention gates are shipped for this tiny model
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "retention", "budget": 8}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "w1", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "w1", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "w1", "n": 1000}, 400, "n"),
    (b'{"model": "tiny", "prompt": "w1", "temperature": NaN}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "w1", "top_p": Infinity}', 400, "top_p"),
    (b'{"model": "tiny", "prompt": "w1", "kv_compression": {"method": "snapkv", "ratio": NaN}}', 400, "kv_compression"),
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt"),  # a lone surrogate: not Unicode text
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "retention", "ratio": 0.5, "checkpoint": "/tmp"}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "snapk:window=4", "ratio": 0.5}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "kv_compression": {"method": "snapkv:window=4", "window": 8, "ratio": 0.5}}, 400, "kv_compression"),
    ({"model": MODEL_NAME, "prompt": "w1", "echo": True}, 400, "echo"),
    ({"model": MODEL_NAME, "prompt": "w1", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL_NAME, "prompt": "w1", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"model": MODEL_NAME, "prompt": "w1", "suffix": "w2"}, 400, "suffix"),
    ({"model": MODEL_NAME, "prompt": "w1", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "w1", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL_NAME, "prompt": "w1", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": MODEL_NAME, "prompt": "w1", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"model": MODEL_NAME, "prompt": "w1", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL_NAME, "prompt": "w1", "stop": 5}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": "w1", "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ({"model": MODEL_NAME, "prompt": "w1", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL_NAME, "prompt": "w1", "tools": [{"type": "function"}]}, 400, "tools"),  # not a completions field
    ({"model": MODEL_NAME, "prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "w1 " * 450}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": [5] * 500, "max_tokens": 20}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + "/v1/completions", **kwargs, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert server.client.completions.create(model=MODEL_NAME, prompt="w1 w2 w3", max_tokens=2).choices


def test_bad_chat_messages_are_refused(server):
    for body in ({"model": MODEL_NAME, "messages": []}, {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]}):
        response = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages")


def test_concurrent_clients_with_mixed_compression_all_complete(server):
    """24 concurrent chat completions: the default method, Ada-KV 0.25, StreamingLLM budget 128, full, Quest
    (dynamic selection, per request) and Quest over SnapKV, some streamed."""
    kinds = [None, {"method": "adakv", "ratio": 0.25}, {"method": "streamingllm", "budget": 128}, {"method": "full"},
             {"method": "quest", "budget": 16, "page_size": 4}, {"method": "snapkv+quest:read_ratio=0.5", "ratio": 0.5}]
    results, errors = {}, []

    def client(i):
        try:
            kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": words(40 + 7 * i, seed=i)}], max_tokens=10,
                          temperature=0)
            if kinds[i % len(kinds)] is not None:
                kwargs["extra_body"] = {"kv_compression": kinds[i % len(kinds)]}
            if i % 3 == 0:
                chunks = list(server.client.chat.completions.create(stream=True, **kwargs))
                results[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].choices[0].finish_reason)
            else:
                out = server.client.chat.completions.create(**kwargs)
                results[i] = (out.choices[0].message.content, out.choices[0].finish_reason)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 24
    assert all(isinstance(text, str) and reason in ("length", "stop") for text, reason in results.values()), results
    assert sum(bool(text) for text, _ in results.values()) >= 20  # answers (an end-of-sequence first gives an empty one)
    values = server.metrics()
    assert values["kvcompress_kv_pool_used_bytes"] == 0 and values["kvcompress_requests_running"] == 0
    assert values["kvcompress_kv_pool_capacity_bytes"] == server.llm.pool.capacity_bytes


def test_a_client_dropped_mid_stream_frees_its_slots(server):
    body = {"model": MODEL_NAME, "prompt": words(80, seed=3), "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    other = server.client.completions.create(model=MODEL_NAME, prompt=words(20), max_tokens=4)
    assert other.choices
    deadline = time.time() + 20
    while time.time() < deadline:
        values = server.metrics()
        if values["kvcompress_requests_running"] == 0 and values["kvcompress_kv_pool_used_bytes"] == 0:
            break
        time.sleep(0.2)
    assert values["kvcompress_requests_running"] == 0 and values["kvcompress_kv_pool_used_bytes"] == 0
    assert values['kvcompress_requests_total{endpoint="completions",outcome="disconnected"}'] >= 1


def test_a_full_queue_answers_429():
    """The one request the server may hold is held in the engine (its steps wait) until the next one was answered."""
    srv = Server(max_queued=1)
    held, step = threading.Event(), srv.llm.step
    srv.llm.step = lambda: held.wait(60) and step()
    try:
        first = threading.Thread(target=lambda: srv.client.completions.create(model=MODEL_NAME, prompt=words(200), max_tokens=60))
        first.start()
        deadline = time.time() + 20
        while srv.app.state.engine["loop"]._pending == 0 and time.time() < deadline:
            time.sleep(0.02)
        response = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "w1", "max_tokens": 2})
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
        held.set()
        first.join(timeout=120)
        assert not first.is_alive()
    finally:
        held.set()
        srv.stop()


SERVE_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from common import tiny_model
    from conftest import tiny_tokenizer
    import kvcompress as kvc
    from kvcompress.serve import run
    llm = kvc.LLM(model_and_tokenizer=(tiny_model(), tiny_tokenizer()), kv_memory="4MiB")
    step = llm.step
    llm.step = lambda: (time.sleep(0.05), step())[1]  # slow steps: the requests in flight outlive the grace period
    run(llm, model_name="tiny", method=kvc.get_method("full"), port={port}, log_level="warning")
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_within_15_seconds_and_requests_in_flight_get_json(tmp_path, sig):
    port = _free_port()
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT.format(tests=str(Path(__file__).parents[1]), port=port))
    process = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, timeout_s=60)
        answers = []

        def ask(stream):
            body = {"model": "tiny", "prompt": "w1 " * 300, "max_tokens": 150, "stream": stream, "ignore_eos": True}
            try:
                answers.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
            except httpx.HTTPError as error:  # the connection closed with the server: no answer to check
                answers.append(error)

        clients = [threading.Thread(target=ask, args=(stream,)) for stream in (True, False)]
        for client in clients:
            client.start()  # long requests in flight when the signal comes
        time.sleep(1.0)
        start = time.time()
        process.send_signal(sig)
        process.wait(timeout=15)
        assert time.time() - start < 15
        for client in clients:
            client.join(timeout=15)
        streamed, whole = answers if isinstance(answers[0], httpx.Response) and answers[0].headers["content-type"].startswith(
            "text/event-stream") else answers[::-1]
        assert whole.status_code == 503 and whole.json()["error"]["type"] == "server_error"  # stopped: JSON, not a plain 500
        events = [line for line in streamed.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and "shut down" in json.loads(events[-2][len("data: "):])["error"]["message"]
    finally:
        if process.poll() is None:
            process.kill()


def test_a_nan_temperature_is_refused_and_the_next_request_answers_with_the_pool_empty(server):
    body = b'{"model": "tiny", "max_tokens": 3, "prompt": "w1 w2", "temperature": NaN}'
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    assert server.client.completions.create(model=MODEL_NAME, prompt="w1 w2 w3", max_tokens=2).choices[0].text is not None
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = server.metrics()
    assert metrics["kvcompress_kv_pool_used_bytes"] == 0 and metrics["kvcompress_requests_running"] == 0


def test_an_engine_bug_fails_the_requests_in_flight_with_a_500_and_the_server_goes_on(server, monkeypatch):
    step = server.llm.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 2:  # after the prefill: the first decoding step raises
            raise RuntimeError("an engine bug")
        return step()

    monkeypatch.setattr(server.llm, "step", broken)
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": words(20), "max_tokens": 5,
                                                                 "ignore_eos": True})
    assert response.status_code == 500 and "an engine bug" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "server_error"
    assert server.client.completions.create(model=MODEL_NAME, prompt="w1 w2 w3", max_tokens=2).choices
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metrics()["kvcompress_kv_pool_used_bytes"] == 0 and server.metrics()["kvcompress_engine_errors"] >= 1


def test_unknown_routes_and_methods_answer_in_openais_shape(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_request_ids_are_uuids_unique_across_requests(server):
    ids = {server.client.completions.create(model=MODEL_NAME, prompt="w1 w2", max_tokens=1).id for _ in range(4)}
    assert len(ids) == 4 and all(len(i.split("-", 1)[1]) == 32 for i in ids)


def test_completion_logprobs_equal_the_engines_and_stream_the_same(server):
    body = {"model": MODEL_NAME, "prompt": words(30, seed=4), "max_tokens": 4, "temperature": 0, "logprobs": 3,
            "kv_compression": {"method": "full"}, "ignore_eos": True}
    choice = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    engine = kvc.LLM(model_and_tokenizer=(server.llm.model, server.llm.tokenizer), kv_memory="2MiB")
    want = engine.generate(body["prompt"], kvc.SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0].logprobs
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in want], abs=1e-5)
    assert [len(top) for top in choice["logprobs"]["top_logprobs"]] == [3] * 4
    assert len(choice["logprobs"]["tokens"]) == 4 and choice["logprobs"]["text_offset"][0] == 0
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [v for c in chunks for v in ((c["choices"][0]["logprobs"] or {}).get("token_logprobs") or [])]
    assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)


def test_chat_logprobs_and_top_logprobs_in_openais_shape(server):
    reply = server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words(12)}],
                                                  max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob <= 0 and item.top_logprobs[0].logprob >= item.logprob - 1e-6 for item in content)
    chunks = list(server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words(12)}],
                                                        max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [item.logprob for item in streamed] == pytest.approx([item.logprob for item in content], abs=1e-6)
    assert [item.token for item in streamed] == [item.token for item in content]


def test_n_answers_come_as_choices_whole_and_streamed(server):
    reply = server.client.completions.create(model=MODEL_NAME, prompt=words(15), max_tokens=3, n=3, temperature=1.0, seed=5,
                                             extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2] and reply.usage.completion_tokens == 9
    chunks = list(server.client.completions.create(model=MODEL_NAME, prompt=words(15), max_tokens=3, n=2, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert server.metrics()["kvcompress_kv_pool_used_bytes"] == 0


def test_fields_not_built_are_refused_naming_them_in_chat(server):
    message = [{"role": "user", "content": "w1"}]
    for extra, field in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"top_logprobs": 2}, "top_logprobs")):
        response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": message, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    fine = {"model": MODEL_NAME, "messages": message, "max_tokens": 1, "response_format": {"type": "text"}, "tools": [],
            "user": "someone"}
    assert httpx.post(server.url + "/v1/chat/completions", json=fine).status_code == 200


def test_a_method_spec_in_kv_compression_is_read_by_the_one_parser(server):
    reply = server.client.completions.create(model=MODEL_NAME, prompt=words(80), max_tokens=2,
                                             extra_body={"kv_compression": {"method": "snapkv:window=4", "ratio": 0.25}})
    assert reply.usage.model_extra["kv_bytes"] < reply.usage.model_extra["kv_bytes_full"] / 2


def test_a_short_prompt_under_the_default_method_answers_as_the_full_cache(server):
    body = {"model": MODEL_NAME, "prompt": "w5 w6 w7 w8 w9", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    default = httpx.post(server.url + "/v1/completions", json=body).json()
    full = httpx.post(server.url + "/v1/completions", json={**body, "kv_compression": {"method": "full"}}).json()
    assert default["choices"][0]["text"] == full["choices"][0]["text"]
    assert default["usage"]["kv_bytes"] == full["usage"]["kv_bytes"]
