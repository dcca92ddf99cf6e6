"""A request's life in the engine (waiting → running → finished) and what it returns."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..methods import Policy
from ..session import Session
from .detokenizer import IncrementalDetokenizer
from .sampling import SamplingParams, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request produced: ``text`` (stop strings cut), ``token_ids``, ``prompt_token_ids``,
    ``finish_reason`` ("stop", "length", "abort" or "error" with ``error`` saying why), ``stats``
    (kv_bytes, kv_bytes_full, kr right after the prompt was compressed and ``*_end`` after the last
    token; ttft_s; decode_s; preemptions), ``index`` (which of its prompt's ``n`` answers this is) and
    ``logprobs`` (one ``TokenLogprob`` per token when ``SamplingParams.logprobs`` asked for them)."""

    request_id: int
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class Request:
    """One prompt being served: its tokens, sampling, method, session and timings."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    method: Policy
    index: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    session: Session | None = None
    generator: torch.Generator | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # the engine's: grows ``text`` token by token
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    suspect: bool = False  # in a batched step that raised: decoded alone until a step of its own succeeds
    to_prefill: int = 0  # tokens of ``tokens`` still to prefill (set when admitted; 0 once it decodes)
    chunked: bool = False  # admitted to be prefilled in chunks over several steps (all its prompt plain until the last)
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilled(self) -> int:
        """Tokens its session holds of a prompt still being prefilled."""
        return len(self.tokens) - self.to_prefill

    @property
    def tokens(self) -> list[int]:
        """Everything the model has seen or will see next: the prompt and the answer so far."""
        return self.prompt_ids + self.output_ids

    def finish(self, reason: str, error: str | None = None) -> None:
        """Done: the text held back for an incomplete character at its end is added as decode shows it."""
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finished_at = time.perf_counter()

    def output(self) -> RequestOutput:
        stats = dict(self.stats)
        stats["preemptions"] = self.preemptions
        stats["new_tokens"] = len(self.output_ids)
        if self.first_token_at is not None:
            stats["ttft_s"] = self.first_token_at - self.arrival
            if self.finished_at is not None and len(self.output_ids) > 1:
                stats["decode_ms_per_token"] = 1000 * (self.finished_at - self.first_token_at) / (len(self.output_ids) - 1)
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        return RequestOutput(self.id, self.text, list(self.output_ids), list(self.prompt_ids), self.finish_reason, stats,
                             self.error, self.index, logprobs)


__all__ = ["Request", "RequestOutput", "Status"]
