"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis): every operation, positive and negative data.

A server on loopback (``test_server``'s tiny random model, answers of at most 8 tokens) serves
``/openapi.json``; schemathesis reads it and sends every operation (``GET /health``, ``/v1/models``,
``/metrics``, ``POST /v1/completions``, ``/v1/chat/completions``) its coverage-phase cases (the
schema's boundaries, each field missing or of the wrong type, other HTTP methods) and a bounded
number of fuzzed cases per generation mode (positive: data the schema allows; negative: data it
does not), deterministically (derandomized Hypothesis, no example database). Every answer must be
a 2xx, or a 4xx whose body is an OpenAI error ``{"error": {"message", "type", "param", "code"}}``:
never a 5xx, never an error that is not JSON, never a hang. A streamed answer is
``text/event-stream`` ending with ``data: [DONE]`` (or an error event that is not a server error).
The requests found failing so far are kept as fixed cases. Afterwards the KV pool is empty,
nothing runs, and a plain completion answers.

The served schema gives the fields' types and ranges; before fuzzing, what only this server knows
is written into it (``_as_served``: its model's name, its limits, its methods, no other fields), so
that positive cases reach the engine instead of being refused at the door, and negative cases
cross those lines too.

Hypothesis is driven directly (``operation.as_strategy`` under ``@given``) rather than through
``schema.parametrize()``: schemathesis' lazy pytest loader (``from_fixture``, needed for a schema
read from a server started by a fixture) breaks on pytest 9 (it writes ``Node._nodeid``).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from kvcompress.methods import REGISTRY, available_methods
from kvcompress.serve.protocol import Limits
from test_server import MODEL_NAME, Server

MAX_EXAMPLES = 150  # fuzzed cases per operation and mode (the coverage phase adds its own, ~600 in all)
LIMITS = Limits(max_prompt_tokens=200, max_tokens=8, max_n=4)  # a big max_tokens or n is refused at once
CALL_TIMEOUT_S = 30  # a request unanswered this long is a hang
GETS = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics")]
POSTS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
SENT: Counter = Counter()  # (method, path, phase, mode, status // 100) of every request sent


@pytest.fixture(scope="module")
def fuzzed_server():
    srv = Server(limits=LIMITS)
    yield srv
    srv.stop()


def _as_served(raw: dict, vocab: int) -> dict:
    """The served OpenAPI document (its fields, model, limits and ranges) with what only depends on this model and
    its methods written into its request bodies, so that a positive case is one the server takes: token ids below
    the vocabulary, ``best_of`` left out (it must equal ``n``), and a method it has with exactly one of budget and
    ratio, or neither when the method sizes itself."""
    methods = available_methods()
    sized = [name for name in methods if REGISTRY[name].needs_budget]
    for _, path in POSTS:
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        fields = body["properties"]
        assert body["additionalProperties"] is False and fields["model"]["enum"] == [MODEL_NAME]
        size = fields["kv_compression"]["properties"]
        fields["kv_compression"] = {"oneOf": [
            {"type": "object", "required": ["method"], "additionalProperties": False,
             "properties": {"method": {"enum": [m for m in methods if m not in sized]}}},
            {"type": "object", "required": ["method", "budget"], "additionalProperties": False,
             "properties": {"method": {"enum": sized}, "budget": size["budget"]}},
            {"type": "object", "required": ["method", "ratio"], "additionalProperties": False,
             "properties": {"method": {"enum": sized}, "ratio": size["ratio"]}}]}
        if "prompt" in fields:
            fields["prompt"]["anyOf"][1]["items"]["maximum"] = vocab - 1
            del fields["best_of"]
    return raw


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    raw = httpx.get(fuzzed_server.url + "/openapi.json", timeout=10).json()
    assert {(method.upper(), path) for path, item in raw["paths"].items() for method in item} == set(GETS + POSTS)
    schema = schemathesis.openapi.from_dict(_as_served(raw, fuzzed_server.llm.model.config.vocab_size))
    schema.config.update(base_url=fuzzed_server.url)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True,
                                    database="none")
    schema.config.max_stream_events = 10_000  # read every stream to its end (schemathesis stops at 20 events)
    schema.config.output.sanitization.enabled = False  # the curl commands in failures show max_tokens, not [Filtered]
    return schema


def _operation(schema, method: str, path: str):
    return schema[path][method]


def _check(case, phase: str) -> None:
    """Send ``case``; its answer must be a 2xx (a stream that ends well) or an OpenAI-shaped 4xx, within the timeout."""
    where = f"\n{case.as_curl_command()}"
    try:
        response = case.call(timeout=CALL_TIMEOUT_S)
    except requests.Timeout:
        raise AssertionError(f"no answer within {CALL_TIMEOUT_S} s{where}") from None
    except requests.RequestException as error:  # the connection dropped or the answer was cut: no HTTP answer
        raise AssertionError(f"{type(error).__name__}: {error}{where}") from None
    status = response.status_code
    SENT[(case.operation.method.upper(), case.operation.path, phase, case.meta.generation.mode.value, status // 100)] += 1
    kind = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), "")
    assert 200 <= status < 300 or 400 <= status < 500, f"{status}: {response.text[:500]}{where}"
    if status >= 400:
        assert kind.startswith("application/json"), f"{status} {kind}: {response.text[:300]}{where}"
        _openai_error(response.json(), where)
    elif case.method.upper() == "POST":
        if isinstance(case.body, dict) and case.body.get("stream") is True:
            assert kind.startswith("text/event-stream"), f"a stream answered as {kind}{where}"
            assert not response.stream_cut_short, f"the stream did not end within {CALL_TIMEOUT_S} s{where}"
            _stream(response.text, where)
        else:
            assert kind.startswith("application/json"), f"{status} {kind}: {response.text[:300]}{where}"
            answer = response.json()
            assert answer["choices"] and answer["usage"]["completion_tokens"] <= LIMITS.max_tokens * len(answer["choices"]), where
    elif case.method.upper() == "GET":
        if case.path == "/metrics":
            assert "kvcompress_kv_pool_used_bytes" in response.text, where
        else:
            assert kind.startswith("application/json") and response.json(), f"{status} {kind}: {response.text[:300]}{where}"


def _openai_error(body, where: str) -> None:
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, f"not an OpenAI error: {body!r}{where}"
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str) and error["type"], where


def _stream(text: str, where: str) -> None:
    """Server-sent events ``data: {json}``, the last ``data: [DONE]`` (or an error); an error must not be a server
    error (the 5xx of a stream)."""
    events = [block for block in text.split("\n\n") if block.strip()]
    assert events and all(event.startswith("data: ") for event in events), f"not server-sent events: {text[:300]!r}{where}"
    payloads = [event[len("data: "):] for event in events]
    for payload in payloads[:-1] if payloads[-1] == "[DONE]" else payloads:
        chunk = json.loads(payload)
        if "error" in chunk:
            _openai_error(chunk, where)
            assert chunk["error"]["type"] != "server_error", f"a server error in the stream: {chunk}{where}"
        else:
            assert "choices" in chunk, f"a stray event {payload[:200]!r}{where}"
    assert payloads[-1] == "[DONE]" or "error" in json.loads(payloads[-1]), f"the stream ends with {payloads[-1][:200]!r}{where}"


@pytest.mark.parametrize("method,path", GETS + POSTS)
def test_coverage_cases_answer_2xx_or_an_openai_4xx(api_schema, method, path):
    """Schemathesis' coverage phase, both modes: boundary values, each field missing or mistyped, other methods."""
    operation = _operation(api_schema, method, path)
    config = api_schema.config.generation_for(operation=operation, phase="coverage")
    cases = list(api_schema.iter_coverage_cases(operation, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                                generation_config=config))
    assert {case.meta.generation.mode for case in cases} == {GenerationMode.POSITIVE, GenerationMode.NEGATIVE}
    failures = []
    for case in cases:  # all of them, then every failure at once
        try:
            _check(case, "coverage")
        except AssertionError as error:
            failures.append(str(error).split("\nassert ")[0])
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n\n" + "\n\n".join(failures)


FUZZED = [(method, path, mode) for method, path in GETS + POSTS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
          if not (method == "GET" and mode is GenerationMode.NEGATIVE)]  # a GET without parameters has no negative data


@pytest.mark.parametrize("method,path,mode", FUZZED, ids=[f"{m} {p} {mode.value}" for m, p, mode in FUZZED])
def test_fuzzed_cases_answer_2xx_or_an_openai_4xx(api_schema, method, path, mode):
    """Schemathesis' fuzzing phase: up to MAX_EXAMPLES cases from the schema (positive) or against it (negative)."""

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
              phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink],  # no explain: it resends for minutes
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=_operation(api_schema, method, path).as_strategy(generation_mode=mode))
    def fuzz(case):
        _check(case, "fuzzing")

    fuzz()


# Requests that got a 5xx while this test was written (the fuzz above found the first five; the last two came from
# probing its neighbours by hand): each must be answered, or refused with a 4xx.
FOUND = [
    {"prompt": "0", "temperature": 5e-324},
    {"prompt": "0", "top_p": 5e-324},
    {"prompt": "0", "repetition_penalty": 5e-324},
    {"prompt": "0", "repetition_penalty": 3.4028235677973366e38},
    {"prompt": "0", "kv_compression": {"method": "gvote"}},  # a one-token prompt
    {"prompt": "0", "kv_compression": {"method": "gvote"}, "stream": True},
    {"prompt": "w1", "seed": 2**70},
    {"prompt": "w1", "kv_compression": {"method": "snapkv", "budget": 10**20}},
]


@pytest.mark.parametrize("body", FOUND, ids=[json.dumps(body) for body in FOUND])
def test_requests_found_failing_are_answered_or_refused(fuzzed_server, body):
    where = f"\n{json.dumps(body)}"
    response = httpx.post(fuzzed_server.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=CALL_TIMEOUT_S)
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}{where}"
    if response.status_code >= 400:
        _openai_error(response.json(), where)
    elif body.get("stream"):
        _stream(response.text, where)


def test_after_the_fuzz_the_pool_is_empty_and_a_completion_answers(fuzzed_server):
    """Runs after the fuzz (file order): each operation got cases of both modes, positive ones reached the engine,
    the pool drained (aborted streams finish asynchronously), and the server still answers."""
    assert SENT, "the fuzz did not run"
    for method, path in GETS + POSTS:
        assert {mode for m, p, _, mode, _ in SENT if (m, p) == (method, path)} == {"positive", "negative"}, (method, path)
    for method, path in POSTS:
        assert sum(n for (m, p, _, mode, status), n in SENT.items() if (m, p, mode, status) == (method, path, "positive", 2)) >= 10
    deadline = time.time() + 20
    while True:
        values = fuzzed_server.metrics()
        if values["kvcompress_kv_pool_used_bytes"] == 0 and values["kvcompress_requests_running"] == 0:
            break
        assert time.time() < deadline, values
        time.sleep(0.2)
    body = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 4}
    response = httpx.post(fuzzed_server.url + "/v1/completions", json=body, timeout=CALL_TIMEOUT_S)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert httpx.get(fuzzed_server.url + "/health").json() == {"status": "ok"}
