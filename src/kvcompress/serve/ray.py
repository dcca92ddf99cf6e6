"""Scale-out on Ray Serve: N replicas of the engine behind one OpenAI endpoint (needs ``kvcompress[ray]``).

    kvcompress serve --replicas 2 --method snapkv --ratio 0.1 --port 8000 [--ray-address ADDR]

Two deployments make the application:

* ``EngineReplica`` (N replicas, each with ``threads`` CPUs): one ``kvc.LLM`` and the OpenAI app of
  ``app.py`` around it, started with its lifespan as on one machine. The router calls ``forward``,
  which runs an HTTP request through that app in process and streams back its status, headers and
  body, so every route, check and error of the single server is the same here.
* ``Router`` (the ingress Ray Serve's HTTP proxy routes to; no CPU of its own): forwards each request
  to an engine replica that Ray picks. When the replica holding a request dies, the client gets a
  503 in OpenAI's JSON shape (or, mid-stream, an error event and the end of the stream), never a
  hang; Ray then starts a replacement, and a replica whose engine thread died fails its health check
  and is replaced the same way.

Request ids are random (``protocol.request_id``), so unique across replicas. ``/metrics`` answers
from the one replica that takes the request; every replica also exports its metrics through Ray's
metrics agent (each node's ``--metrics-export-port``, which Prometheus scrapes through Ray's
service-discovery file), named ``ray_<name>`` with a ``replica`` label. Counters go out as gauges
holding the running total.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from dataclasses import dataclass, field

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.util.metrics import Gauge

from ..engine import LLM
from ..methods import MethodSpec
from .app import build_app
from .protocol import APIError, Limits

APP_NAME = "kvcompress"
REPLICA_STOPPED = ("the engine replica serving this request stopped before it finished ({error}); Ray is starting another: "
                   "retry the request")


@dataclass
class ReplicaSpec:
    """What each engine replica builds: ``kvc.LLM``'s arguments, the default method (a spec string, checked
    here), the server's limits, and the CPU threads each replica uses (also its Ray CPU reservation)."""

    model: str | None = None
    method: str = "full"
    kv_memory: int | str = "1GiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_queued: int = 256
    served_model_name: str | None = None
    threads: int = 1
    grace_s: float = 8.0
    metrics_interval_s: float = 5.0
    options: dict = field(default_factory=dict)  # ``budget`` or ``ratio`` of the default method

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads per replica must be ≥ 1, got {self.threads}")
        MethodSpec.parse(self.method).build(**self.options)  # a bad method fails here, not in every replica


class EngineReplica:
    """One engine and its OpenAI app (see the module docstring)."""

    async def __init__(self, spec: ReplicaSpec):
        torch.set_num_threads(spec.threads)
        self.llm = LLM(spec.model, kv_memory=spec.kv_memory, max_num_seqs=spec.max_num_seqs,
                       max_num_batched_tokens=spec.max_num_batched_tokens, device=spec.device, dtype=spec.dtype, seed=spec.seed,
                       max_model_len=spec.max_model_len)
        limits = Limits(max_prompt_tokens=spec.max_prompt_tokens or self.llm.max_model_len - 1,
                        max_tokens=spec.max_tokens or self.llm.max_model_len - 1)
        method = MethodSpec.parse(spec.method).build(**spec.options)
        self.app = build_app(self.llm, model_name=spec.served_model_name or spec.model or "smollm2-135m-instruct", method=method,
                             limits=limits, max_queued=spec.max_queued, grace_s=spec.grace_s)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        replica = serve.get_replica_context().replica_id.unique_id
        self._export = _MetricsExport(self.app, self.llm, replica, spec.metrics_interval_s)

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes):
        """Run one HTTP request through the app; yield ``(status, headers)`` once, then the body's chunks. A
        cancelled call (the client went away) cancels the handler, which aborts its answers."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        sent: asyncio.Queue = asyncio.Queue()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop()
            await asyncio.Future()  # no more body; a disconnect comes as this call's cancellation

        handler = asyncio.create_task(self.app(scope, receive, sent.put))
        handler.add_done_callback(lambda _: sent.put_nowait(None))
        started = False
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    started = True
                    yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if not started:  # the app ended without answering (it always answers: its error handlers are in place)
                failure = APIError(500, "internal error: the engine replica's app gave no response", type="server_error")
                yield failure.status, [("content-type", "application/json")]
                yield json.dumps(failure.body()).encode()
            await asyncio.wait([handler], timeout=5.0)  # what the handler does after its last byte (metrics, clean-up)
        finally:
            if not handler.done():  # the call was cancelled: the client went away
                handler.cancel()
            elif not handler.cancelled():
                handler.exception()  # marks it seen: the app's error handler answered it (a 500) and re-raised it

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread stopped is replaced."""
        loop = self.app.state.engine.get("loop")
        if loop is None or not loop.alive:
            raise RuntimeError("the engine loop of this replica is not running")

    async def __del__(self):
        """Ray's graceful shutdown: running requests finish within the grace period, the rest are answered 503."""
        self._export.stop()
        await self._lifespan.__aexit__(None, None, None)


class Router:
    """The ingress: forwards every request to an engine replica, and answers in OpenAI's shape when one dies."""

    def __init__(self, engine):
        self.engine = engine.options(stream=True)
        self.routes = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)  # all of it, docs too, is the engine app's
        self.routes.add_api_route("/{path:path}", self.forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])

    def __serve_build_asgi_app__(self):
        return self.routes

    async def forward(self, request: Request):
        body = await request.body()
        stream = self.engine.forward.remote(request.method, request.url.path, request.url.query.encode(), request.headers.raw, body)
        try:
            status, headers = await stream.__anext__()
        except RayError as error:
            return _json(_failure(error))
        if dict(headers).get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(stream), status_code=status,
                                     headers={k: v for k, v in headers if k != "content-length"})
        try:
            content = b"".join([chunk async for chunk in stream])
        except RayError as error:
            return _json(_failure(error))
        return Response(content, status_code=status, headers=dict(headers))


async def _relay(stream):
    """A streamed answer's events; when its replica dies, an error event in OpenAI's shape, then the end."""
    try:
        async for chunk in stream:
            yield chunk
    except RayError as error:
        yield f"data: {json.dumps(_failure(error).body())}\n\n".encode()
    finally:
        stream.cancel()


def _failure(error: RayError) -> APIError:
    """503 when the replica stopped (retry elsewhere), 500 for anything else Ray raised."""
    if isinstance(error, (RayActorError, ActorUnavailableError)):  # ActorDiedError is a RayActorError
        return APIError(503, REPLICA_STOPPED.format(error=type(error).__name__), type="server_error")
    return APIError(500, f"internal error in an engine replica ({type(error).__name__}: {error})", type="server_error")


def _json(failure: APIError) -> JSONResponse:
    return JSONResponse(failure.body(), status_code=failure.status)


class _MetricsExport:
    """Copies a replica's Prometheus registry into Ray's metrics every ``interval_s`` seconds (a daemon thread),
    each sample with its labels plus ``replica``."""

    def __init__(self, app: FastAPI, llm: LLM, replica: str, interval_s: float):
        self.app, self.llm, self.replica, self.interval_s = app, llm, replica, interval_s
        self._gauges: dict[str, Gauge] = {}
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="kvcompress-ray-metrics", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.export()

    def export(self) -> None:
        loop = self.app.state.engine.get("loop")
        if loop is None:
            return
        self.app.state.metrics.refresh(self.llm, loop)
        for family in self.app.state.metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                gauge = self._gauges.get(sample.name)
                if gauge is None:
                    keys = (*sorted(sample.labels), "replica")
                    gauge = self._gauges[sample.name] = Gauge(sample.name, family.documentation, tag_keys=keys)
                gauge.set(sample.value, tags={**sample.labels, "replica": self.replica})


def application(spec: ReplicaSpec, replicas: int = 1, health_check_period_s: float = 5.0):
    """The Ray Serve application: ``replicas`` engine replicas behind the router (``serve.run`` it)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be ≥ 1, got {replicas}")
    engine = serve.deployment(EngineReplica, name="Engine", num_replicas=replicas,
                              ray_actor_options={"num_cpus": spec.threads}, max_ongoing_requests=spec.max_queued + 8,
                              health_check_period_s=health_check_period_s, graceful_shutdown_timeout_s=spec.grace_s + 2)
    router = serve.deployment(serve.ingress()(Router), name="Router", ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=replicas * (spec.max_queued + 8))
    return router.bind(engine.bind(spec))


def deploy(spec: ReplicaSpec, replicas: int, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
           health_check_period_s: float = 5.0) -> str:
    """Start (or join, with ``address``) a Ray cluster and run the application on it; returns its URL."""
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(spec, replicas, health_check_period_s), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def run(spec: ReplicaSpec, replicas: int, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None) -> None:
    """``kvcompress serve --replicas N``: deploy, serve until SIGTERM or Ctrl-C, then shut the application
    down gracefully (replicas finish or stop their requests within the grace period)."""
    stop = threading.Event()
    try:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs a SIGTERM handler of its own
            signal.signal(sig, lambda *_: stop.set())
        url = deploy(spec, replicas, host=host, port=port)
        print(f"serving on {url} with {replicas} engine replicas (Ray Serve, pid {os.getpid()})", flush=True)
        stop.wait()
    finally:
        if ray.is_initialized():
            serve.delete(APP_NAME)
            serve.shutdown()
            ray.shutdown()


__all__ = ["APP_NAME", "EngineReplica", "ReplicaSpec", "Router", "application", "deploy", "run"]
