"""``serve --replicas``: the OpenAI app as engine replicas on Ray Serve — both replicas answer, ids are unique,
errors keep OpenAI's shape through the router, every replica's metrics reach Ray's export, and a killed
replica fails its requests cleanly (no hang) and is replaced."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_config, tiny_tokenizer

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from kvcompress.cli import main as cli_main  # noqa: E402
from kvcompress.serve import wait_healthy  # noqa: E402
from kvcompress.serve.ray import APP_NAME, ReplicaSpec, deploy  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1 {% endif %}"
MAX_TOKENS = 400
PROMPT = " ".join(f"w{2 + (i * 7) % 60}" for i in range(40))


@pytest.fixture(scope="module")
def url(ray_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(7)
    config = tiny_config("llama")
    config.max_position_embeddings = 512
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharp logits: greedy answers do not depend on batching
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    spec = ReplicaSpec(model=str(path), method="snapkv:window=8", options={"budget": 24}, kv_memory="8MiB", max_num_seqs=16,
                       max_prompt_tokens=200, max_tokens=400, served_model_name="tiny", metrics_interval_s=0.5, grace_s=2.0)
    port = _free_port()
    address = deploy(spec, replicas=2, port=port, health_check_period_s=1.0)
    wait_healthy(address, timeout_s=120)
    yield address
    serve.delete(APP_NAME)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _ray_metric(port: int, name: str) -> dict[str, float]:
    """``ray_<name>`` per replica, from Ray's Prometheus export."""
    values: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"ray_{name}{{"):
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_concurrent_requests_use_both_replicas_with_unique_ids(url, ray_cluster):
    client = _client(url)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8 + i % 3,
                                                                     temperature=0), range(24)))
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    assert len({a.id for a in answers}) == len(answers)
    texts = {(len(a.choices[0].text.split()), a.choices[0].text) for a in answers}
    assert len({t for n, t in texts if n == 8}) == 1, "one prompt, one greedy answer, whichever replica served it"
    deadline = time.time() + 30
    while time.time() < deadline:  # each replica exports its own counts every half second; Ray's agent every second
        served = _ray_metric(ray_cluster, "kvcompress_generated_tokens_total")
        if len(served) >= 2 and sum(served.values()) >= sum(len(a.choices[0].text.split()) for a in answers):
            break
        time.sleep(0.5)
    assert len([v for v in served.values() if v > 0]) == 2, f"tokens per replica: {served}"


def test_streaming_and_chat_pass_through_the_router(url):
    client = _client(url)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                                     stream=True) if c.choices]
    assert "".join(parts) == whole
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_errors_keep_openai_shape_through_the_router(url):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "temperature": float("nan")})  # NaN, as Python writes it
    bad = httpx.post(url + "/v1/completions", content=body, timeout=30, headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    missing = httpx.get(url + "/v2/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}


def _engine_replicas() -> list:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#Engine#")]


def test_a_killed_replica_fails_its_requests_cleanly_and_is_replaced(url):
    before = {a["name"] for a in _engine_replicas()}
    assert len(before) == 2
    client = _client(url)

    started = threading.Semaphore(0)

    def stream() -> str:
        try:
            chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            words = 0
            for chunk in chunks:
                if words == 0:
                    started.release()
                words += sum(len(c.text.split()) for c in chunk.choices)
            return "done" if words == MAX_TOKENS else "cut"
        except openai.APIError as error:  # the error event of the stream, in OpenAI's shape
            assert "replica" in str(error), error
            return "failed"

    def whole() -> str:
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                            "ignore_eos": True}, timeout=60)
        if response.status_code == 200:
            return "done"
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error", response.text
        return "failed"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream if i % 2 else whole) for i in range(8)]
        for _ in range(4):  # every stream has its first token: they are decoding, far from their last
            assert started.acquire(timeout=60)
        for actor in _engine_replicas():
            ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
        outcomes = [f.result(timeout=90) for f in futures]  # none hangs
    assert outcomes[1::2] == ["failed"] * 4 and "cut" not in outcomes, outcomes
    deadline = time.time() + 90
    while time.time() < deadline:
        names = {a["name"] for a in _engine_replicas()}
        if len(names - before) == 2:
            break
        time.sleep(0.5)
    assert len(names - before) == 2, "Ray did not replace the killed replicas"
    wait_healthy(url, timeout_s=90)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices[0].finish_reason == "length"


def test_the_command_serves_on_ray_and_stops_on_sigterm(tiny_checkpoint, tmp_path):
    """``kvcompress serve --replicas 1`` in its own process (its own local Ray): it answers, and SIGTERM ends it."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="kvc-ray-", dir="/tmp")}
    command = [sys.executable, "-m", "kvcompress.cli", "serve", "--model", str(tiny_checkpoint("llama")), "--replicas", "1",
               "--kv-memory", "4MiB", "--port", str(port), "--quiet"]
    log = tmp_path / "serve.log"
    server = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, server, timeout_s=180)
        except RuntimeError as error:  # say why: the server's own last words
            raise AssertionError(f"{error} (exit code {server.poll()}); its log ends:\n{log.read_text()[-3000:]}") from error
        answer = _client(url).completions.create(model=_client(url).models.list().data[0].id, prompt="w3 w4 w5", max_tokens=3)
        assert answer.usage.completion_tokens >= 1
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=90) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def test_without_replicas_nothing_imports_ray():
    code = "import sys, kvcompress.cli, kvcompress.serve.app, kvcompress.eval.runner; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_ray_flags_without_their_switch_are_refused(capsys):
    assert cli_main(["serve", "--ray-address", "auto"]) == 2
    assert "add --replicas" in capsys.readouterr().err
