"""The engine's loop in a background thread: HTTP handlers submit requests and read events, never block it.

Handlers check a request (``LLM.check_prompt``) in their own thread and ``submit`` it with an
event sink; the loop thread owns the engine: it adds submitted requests, carries out aborts,
runs ``LLM.step`` and sends each touched request's new text (holding back what a stop string
may still cut) and, at the end, its ``RequestOutput``. ``shutdown`` stops accepting, lets
running requests finish within a grace period, aborts the rest and joins the thread.

The loop never dies of a request: the engine fails a request that breaks on its own
(``finish_reason="error"``); should a step raise anyway (a bug), every request in the engine then
is failed with the error, its slots freed, and the loop goes on serving (``errors`` counts it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine import LLM, RequestOutput, SamplingParams, TokenLogprob
from ..methods import Policy


SHUT_DOWN = "the server shut down before this request finished; retry it on another server"


class QueueFull(RuntimeError):
    """More requests wait than the server accepts (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server stops: no new request is accepted (HTTP 503)."""


@dataclass
class Event:
    """Sent to a request's sink: new ``text`` (a delta), the ``logprobs`` of the tokens since the last event
    (when asked for) and, on the last event, ``output``."""

    text: str = ""
    output: RequestOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    method: Policy
    sink: Callable[[Event], None]
    index: int = 0
    id: int | None = None
    sent: int = 0  # characters of text already sent
    sent_logprobs: int = 0  # tokens whose logprobs were sent
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        self.holdback = max((len(s) for s in self.params.stop), default=1) - 1


class EngineLoop:
    """Runs an ``LLM`` in one background thread (see the module docstring)."""

    def __init__(self, llm: LLM, max_queued: int = 256):
        self.llm = llm
        self.max_queued = max_queued
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, _Job] = {}
        self._accepting = True
        self._stop_by: float | None = None
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet finished (for 429)
        self.errors = 0  # steps that raised (each failed the requests then in the engine)
        self._thread = threading.Thread(target=self._run, name="kvcompress-engine", daemon=True)
        self._thread.start()

    # ----- for the handlers (any thread) ---------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, method: Policy, sink: Callable[[Event], None],
               index: int = 0) -> _Job:
        """Queue a checked request (answer ``index`` of its prompt); its events go to ``sink`` (called from the
        loop thread)."""
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if self._pending >= self.max_queued:
                raise QueueFull(f"{self._pending} requests are queued or running (the limit is {self.max_queued}); retry later")
            self._pending += 1
        job = _Job(prompt_ids, params, method, sink, index)
        self._inbox.put(("add", job))
        return job

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (False once shutdown began)."""
        return self._accepting

    @property
    def alive(self) -> bool:
        """Whether the loop thread runs (it ends only at shutdown)."""
        return self._thread.is_alive()

    def abort(self, job: _Job) -> None:
        """Stop a request (a client went away); its slots go back to the pool."""
        self._inbox.put(("abort", job))

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        scheduler = self.llm.scheduler
        return len(scheduler.running), len(scheduler.waiting) + self._inbox.qsize()

    def stop_accepting(self) -> None:
        """New submissions get ``ShuttingDown`` (HTTP 503) from now on."""
        with self._lock:
            self._accepting = False

    def begin_shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting; running requests may finish within ``grace_s`` seconds, then the rest are stopped (their
        answers say the server shut down). Returns at once (a signal handler calls it)."""
        self.stop_accepting()
        if self._stop_by is None:
            self._stop_by = time.monotonic() + grace_s
        self._inbox.put(("wake", None))

    def shutdown(self, grace_s: float = 10.0) -> None:
        """``begin_shutdown``, then wait for the loop to end."""
        self.begin_shutdown(grace_s)
        self._thread.join(timeout=max(0.0, self._stop_by - time.monotonic()) + 5.0)

    # ----- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._drain(block=not self.llm.has_unfinished())
            if self._stop_by is not None and (not self.llm.has_unfinished() or time.monotonic() > self._stop_by):
                for job in list(self._jobs.values()):
                    self.llm.abort(job.id, "abort", SHUT_DOWN)
                self._report(list(self._jobs.values()))
                return
            if self.llm.has_unfinished():
                self._step()

    def _step(self) -> None:
        """One engine step and its events; a step that raises fails every request in the engine, not the loop."""
        try:
            touched = self.llm.step()
        except Exception as error:
            self.errors += 1
            message = f"internal engine error ({type(error).__name__}: {error}); the request was stopped and the server goes on"
            for job in list(self._jobs.values()):
                self.llm.abort(job.id, "error", message)
            self._report(list(self._jobs.values()))
            return
        self._report([self._jobs[r.id] for r in touched if r.id in self._jobs])

    def _drain(self, block: bool) -> None:
        """Carry out what the handlers asked for (waiting for it when there is nothing else to do)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, job = item
            if kind == "add":
                self._add(job)
            elif kind == "abort" and job.id is not None and job.id in self._jobs:
                self.llm.abort(job.id)
                self._report([job])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: _Job) -> None:
        """Hand a job to the engine; one the engine refuses (checked in its handler, so a race) ends with that error."""
        try:
            job.id = self.llm.add_request(job.prompt_ids, job.params, job.method, job.index)
        except Exception as error:
            with self._lock:
                self._pending -= 1
            job.sink(Event(output=RequestOutput(-1, "", [], job.prompt_ids, "error", error=str(error), index=job.index)))
            return
        self._jobs[job.id] = job
        self._report([job])  # a request that can never fit is finished already

    def _report(self, jobs: list[_Job]) -> None:
        """Send each job's new text; the output once it is finished."""
        for job in jobs:
            request = self.llm.request(job.id)
            if request is None:
                continue
            text = request.text
            done = request.finished
            upto = len(text) if done else max(job.sent, len(text) - job.holdback)
            logprobs = request.logprobs[job.sent_logprobs :] if upto > job.sent or done else []
            if upto > job.sent or logprobs:
                job.sink(Event(text=text[job.sent : upto], logprobs=logprobs))
                job.sent, job.sent_logprobs = upto, job.sent_logprobs + len(logprobs)
            if done:
                del self._jobs[job.id]
                with self._lock:
                    self._pending -= 1
                job.sink(Event(output=self.llm.output(job.id)))


__all__ = ["SHUT_DOWN", "EngineLoop", "Event", "QueueFull", "ShuttingDown"]
