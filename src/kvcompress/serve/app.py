"""The OpenAI-compatible HTTP server over the engine (FastAPI).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming by server-sent
events ending with ``data: [DONE]``), ``/health``, ``/metrics`` (Prometheus text). The engine
runs in one background thread (``EngineLoop``); handlers check a request in their own thread,
submit it and await its events, so no handler blocks the engine. A client that disconnects
has its request aborted and its slots freed.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import LLM
from ..methods import Policy
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
        self.engine_errors = gauge("kvcompress_engine_errors", "engine steps that raised (their requests failed, the server went on)")
        self.latency = Histogram("kvcompress_request_latency_seconds", "time to the whole answer", registry=self.registry,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def refresh(self, llm: LLM, loop: EngineLoop) -> None:
        """Set the gauges that read the engine's state (before each scrape)."""
        running, waiting = loop.counts
        self.pool_used.set(llm.pool.used_bytes)
        self.pool_capacity.set(llm.pool.capacity_bytes)
        self.running.set(running)
        self.waiting.set(waiting)
        self.engine_errors.set(loop.errors)


def build_app(llm: LLM, *, model_name: str, method: Policy, limits: Limits | None = None, max_queued: int = 256,
              grace_s: float = 10.0) -> FastAPI:
    """A FastAPI app serving ``llm`` (started and stopped with the app's lifespan)."""
    limits = limits or Limits(max_prompt_tokens=llm.max_model_len - 1, max_tokens=llm.max_model_len - 1)
    metrics = _Metrics()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["loop"] = EngineLoop(llm, max_queued)
        yield
        await asyncio.to_thread(state["loop"].shutdown, grace_s)

    app = FastAPI(title="kvcompress", lifespan=lifespan)
    app.state.engine = state
    app.state.metrics = metrics
    _error_handlers(app)

    @app.get("/health")
    async def health():
        loop = state.get("loop")
        if loop is None or not loop.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        if not loop.accepting:
            raise APIError(503, "the server is shutting down", type="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvcompress",
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        metrics.refresh(llm, state["loop"])
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def serve(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await _body(request)
            parsed = protocol.parse(body, chat=chat, model_name=model_name, default_method=method, limits=limits)
            prompt_ids = await asyncio.to_thread(_prompt_ids, llm, parsed, limits)
        except APIError:
            metrics.requests.labels(endpoint, "bad_request").inc()
            raise
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        jobs = _submit(state["loop"], prompt_ids, parsed, queue, metrics, endpoint)
        request_id = protocol.request_id(chat)
        started = time.perf_counter()
        if parsed.stream:
            stream = _stream(state["loop"], jobs, queue, request_id, model_name, chat, parsed, metrics, endpoint, started, llm.tokenizer)
            return StreamingResponse(stream, media_type="text/event-stream")
        outputs = await _wait(request, state["loop"], jobs, queue)
        if outputs is None:  # the client went away
            metrics.requests.labels(endpoint, "disconnected").inc()
            return JSONResponse({}, status_code=499)
        for output in outputs:
            _observe(metrics, endpoint, output, started)
        failed = next((o for o in outputs if o.finish_reason in ("error", "abort")), None)
        if failed is not None:
            raise _failure(failed)
        return protocol.completion(request_id, model_name, outputs, chat, llm.tokenizer)

    @app.post("/v1/completions", openapi_extra=protocol.openapi_body(False, model_name, limits))
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=protocol.openapi_body(True, model_name, limits))
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's JSON shape: the API's own, unknown routes and methods (404/405), and any bug (500,
    the server goes on)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}; routes: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, message, type=kind).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception):
        message = f"internal error ({type(error).__name__}: {error}); the server goes on"
        return JSONResponse(APIError(500, message, type="server_error").body(), status_code=500)


async def _body(request: Request):
    """The request's JSON (NaN and Infinity are read as Python reads them, then refused field by field)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None


def _submit(loop: EngineLoop, prompt_ids: list[int], parsed: protocol.Parsed, queue: asyncio.Queue, metrics, endpoint: str):
    """One engine request per answer (``n``), their events tagged with the answer's index; none if any is refused."""
    running = asyncio.get_running_loop()
    jobs = []
    try:
        for index in range(parsed.params.n):
            sink = lambda event, i=index: running.call_soon_threadsafe(queue.put_nowait, (i, event))  # noqa: E731
            jobs.append(loop.submit(prompt_ids, parsed.params, parsed.method, sink, index))
    except (QueueFull, ShuttingDown) as error:
        for job in jobs:
            loop.abort(job)
        if isinstance(error, QueueFull):
            metrics.requests.labels(endpoint, "rejected").inc()
            raise APIError(429, str(error), type="rate_limit_error") from None
        raise APIError(503, str(error), type="server_error") from None
    return jobs


def _failure(output) -> APIError:
    """The error answered for an answer the engine failed or stopped: 503 when the server shut down, 400 when
    the prompt cannot fit the pool, else 500."""
    message = output.error or "the request failed"
    if output.finish_reason == "abort":
        return APIError(503, message, type="server_error")
    status = 400 if "KV pool" in message or "KV slots" in message else 500
    return APIError(status, message, type="invalid_request_error" if status == 400 else "server_error")


def _prompt_ids(llm: LLM, parsed: protocol.Parsed, limits: Limits) -> list[int]:
    """The prompt's token ids (chat: the model's template), checked against the limits and the pool."""
    field = "messages" if parsed.messages is not None else "prompt"
    try:
        ids = llm.check_prompt(llm.chat_prompt(parsed.messages) if parsed.messages is not None else parsed.prompt, parsed.params)
    except ValueError as error:
        raise APIError(400, str(error), field) from None
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}", field)
    try:
        parsed.method.check_model(llm.model.config)  # e.g. retention gates trained for another model
    except (ValueError, OSError) as error:
        raise APIError(400, f"kv_compression: {error}", "kv_compression") from None
    try:
        llm.check_fits(ids, parsed.params, parsed.method)
    except ValueError as error:
        raise APIError(400, str(error), "max_tokens") from None
    return ids


async def _wait(request: Request, loop: EngineLoop, jobs: list, queue: asyncio.Queue):
    """The outputs of a non-streamed request, by index; None (and every answer aborted) when the client disconnects.
    A handler cancelled while it waits (its server stops it, or a caller in front of it, such as the Ray router,
    gives up) aborts its answers too, so no slot stays held for an answer nobody reads."""
    outputs: dict[int, object] = {}
    try:
        while len(outputs) < len(jobs):
            try:
                index, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    for job in jobs:
                        loop.abort(job)
                    return None
                continue
            if event.output is not None:
                outputs[index] = event.output
    except asyncio.CancelledError:
        for job in jobs:
            loop.abort(job)
        raise
    return [outputs[i] for i in range(len(jobs))]


async def _stream(loop: EngineLoop, jobs: list, queue: asyncio.Queue, request_id: str, model: str, chat: bool, parsed, metrics,
                  endpoint: str, started: float, tokenizer):
    """Server-sent events: each answer's text as it comes (with its tokens' logprobs if asked), its finish
    reason, then the usage if asked, then [DONE]. An answer the engine failed ends the stream with an error."""
    outputs: dict[int, object] = {}
    offsets = [0] * len(jobs)
    try:
        if chat:
            for index in range(len(jobs)):
                yield _sse(protocol.chunk(request_id, model, chat, index, role=True))
        while len(outputs) < len(jobs):
            index, event = await queue.get()
            if event.text or event.logprobs:
                logprobs = protocol.logprobs(tokenizer, event.logprobs, chat, offsets[index]) if parsed.params.logprobs is not None else None
                yield _sse(protocol.chunk(request_id, model, chat, index, text=event.text, logprobs=logprobs))
                offsets[index] += len(event.text)
            if event.output is None:
                continue
            outputs[index] = event.output
            _observe(metrics, endpoint, event.output, started)
            if event.output.finish_reason in ("error", "abort"):
                yield _sse(_failure(event.output).body())
                break
            yield _sse(protocol.chunk(request_id, model, chat, index, finish=protocol.finish_reason(event.output)))
        else:
            if parsed.include_usage:
                yield _sse(protocol.chunk(request_id, model, chat, outputs=[outputs[i] for i in range(len(jobs))]))
        yield "data: [DONE]\n\n"
    finally:
        if len(outputs) < len(jobs):  # the client disconnected mid-stream, or an answer failed: stop the rest
            for job in jobs:
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
