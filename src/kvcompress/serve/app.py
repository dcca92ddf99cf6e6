"""The OpenAI-compatible HTTP server over the engine (FastAPI).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming by server-sent
events ending with ``data: [DONE]``), ``/health``, ``/metrics`` (Prometheus text). The engine
runs in one background thread (``EngineLoop``); handlers check a request in their own thread,
submit it and await its events, so no handler blocks the engine. A client that disconnects
has its request aborted and its slots freed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import LLM
from ..methods import Method
from . import protocol
from .loop import EngineLoop, Event, QueueFull, ShuttingDown
from .protocol import APIError, Limits


class _Metrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        gauge = lambda name, doc: Gauge(name, doc, registry=self.registry)  # noqa: E731
        self.pool_used = gauge("kvcompress_kv_pool_used_bytes", "KV slot pool bytes held by requests")
        self.pool_capacity = gauge("kvcompress_kv_pool_capacity_bytes", "KV slot pool size in bytes")
        self.running = gauge("kvcompress_requests_running", "requests being decoded")
        self.waiting = gauge("kvcompress_requests_waiting", "requests waiting for KV memory")
        self.requests = Counter("kvcompress_requests_total", "requests answered", ["endpoint", "outcome"], registry=self.registry)
        self.tokens = Counter("kvcompress_generated_tokens_total", "tokens generated", registry=self.registry)
        self.ttft = Histogram("kvcompress_time_to_first_token_seconds", "time to the first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.latency = Histogram("kvcompress_request_latency_seconds", "time to the whole answer", registry=self.registry,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))


def build_app(llm: LLM, *, model_name: str, method: Method, limits: Limits | None = None, max_queued: int = 256,
              grace_s: float = 10.0) -> FastAPI:
    """A FastAPI app serving ``llm`` (started and stopped with the app's lifespan)."""
    limits = limits or Limits(max_prompt_tokens=llm.max_model_len - 1, max_tokens=llm.max_model_len - 1)
    metrics = _Metrics()
    ids = itertools.count()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["loop"] = EngineLoop(llm, max_queued)
        yield
        await asyncio.to_thread(state["loop"].shutdown, grace_s)

    app = FastAPI(title="kvcompress", lifespan=lifespan)
    app.state.engine = state
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health():
        loop = state.get("loop")
        if loop is None or loop.error is not None:
            raise APIError(503, "the engine is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvcompress",
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        running, waiting = state["loop"].counts
        metrics.pool_used.set(llm.pool.used_bytes)
        metrics.pool_capacity.set(llm.pool.capacity_bytes)
        metrics.running.set(running)
        metrics.waiting.set(waiting)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def serve(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            metrics.requests.labels(endpoint, "bad_request").inc()
            raise APIError(400, "the request body is not valid JSON") from None
        try:
            parsed = protocol.parse(body, chat=chat, model_name=model_name, default_method=method, limits=limits)
            prompt_ids = await asyncio.to_thread(_prompt_ids, llm, parsed, limits)
        except APIError:
            metrics.requests.labels(endpoint, "bad_request").inc()
            raise
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            job = state["loop"].submit(prompt_ids, parsed.params, parsed.method, lambda e: loop.call_soon_threadsafe(queue.put_nowait, e))
        except QueueFull as error:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise APIError(429, str(error), type="rate_limit_error") from None
        except ShuttingDown as error:
            raise APIError(503, str(error), type="server_error") from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}"
        started = time.perf_counter()
        if parsed.stream:
            return StreamingResponse(_stream(state["loop"], job, queue, request_id, model_name, chat, parsed, metrics, endpoint, started),
                                     media_type="text/event-stream")
        output = await _wait(request, state["loop"], job, queue)
        if output is None:  # the client went away
            metrics.requests.labels(endpoint, "disconnected").inc()
            return JSONResponse({}, status_code=499)
        _observe(metrics, endpoint, output, started)
        if output.finish_reason == "error":
            raise APIError(400 if "KV" in (output.error or "") else 500, output.error or "error", type="server_error")
        return protocol.completion(request_id, model_name, output, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def _prompt_ids(llm: LLM, parsed: protocol.Parsed, limits: Limits) -> list[int]:
    """The prompt's token ids (chat: the model's template), checked against the limits and the pool."""
    if parsed.messages is not None:
        if not llm.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        text = llm.tokenizer.apply_chat_template(parsed.messages, tokenize=False, add_generation_prompt=True)
        prompt: str | list[int] = llm.tokenizer(text, add_special_tokens=False).input_ids
    else:
        prompt = parsed.prompt
    try:
        ids = llm.check_prompt(prompt, parsed.params)
    except ValueError as error:
        raise APIError(400, str(error), "messages" if parsed.messages is not None else "prompt") from None
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}",
                       "messages" if parsed.messages is not None else "prompt")
    try:
        parsed.method.check_model(llm.model.config)  # e.g. retention gates trained for another model
    except ValueError as error:
        raise APIError(400, f"kv_compression: {error}", "kv_compression") from None
    try:
        llm.check_fits(ids, parsed.params, parsed.method)
    except ValueError as error:
        raise APIError(400, str(error), "max_tokens") from None
    return ids


async def _wait(request: Request, loop: EngineLoop, job, queue: asyncio.Queue):
    """The output of a non-streamed request; None (and the request aborted) when the client disconnects."""
    while True:
        try:
            event = await asyncio.wait_for(queue.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                loop.abort(job)
                return None
            continue
        if event.output is not None:
            return event.output


async def _stream(loop: EngineLoop, job, queue: asyncio.Queue, request_id: str, model: str, chat: bool, parsed, metrics,
                  endpoint: str, started: float):
    """Server-sent events: the text as it comes, the finish reason, the usage if asked, then [DONE]."""
    finished = False
    try:
        if chat:
            yield _sse(protocol.chunk(request_id, model, chat, role=True))
        while True:
            event = await queue.get()
            if event.text:
                yield _sse(protocol.chunk(request_id, model, chat, text=event.text))
            if event.output is not None:
                finished = True
                _observe(metrics, endpoint, event.output, started)
                if event.output.finish_reason == "error":
                    yield _sse(APIError(500, event.output.error or "error", type="server_error").body())
                else:
                    yield _sse(protocol.chunk(request_id, model, chat, finish=protocol.finish_reason(event.output)))
                    if parsed.include_usage:
                        yield _sse(protocol.chunk(request_id, model, chat, output=event.output))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client disconnected mid-stream
            loop.abort(job)
            metrics.requests.labels(endpoint, "disconnected").inc()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _observe(metrics: _Metrics, endpoint: str, output, started: float) -> None:
    metrics.requests.labels(endpoint, output.finish_reason or "unknown").inc()
    metrics.tokens.inc(len(output.token_ids))
    metrics.latency.observe(time.perf_counter() - started)
    if "ttft_s" in output.stats:
        metrics.ttft.observe(output.stats["ttft_s"])


__all__ = ["build_app"]
