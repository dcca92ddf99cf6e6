"""Sampling parameters of a request and the sampler, as vLLM defines them.

The next-token logits go through, in order: the repetition penalty (prompt and answer tokens), the
frequency and presence penalties (answer tokens), the temperature (0 = greedy), top-k, top-p,
then a draw from the request's own generator. Log-probabilities, when asked for, are those of the
model's own logits (``log_softmax`` in float32, before any of these steps), as vLLM reports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels import cpu_kernels

MAX_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's top_logprobs limit)
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's rule: dividing by it would overflow)
LOGIT_LIMIT = 1e4  # penalized logits are clamped to ±this, so no penalty can make them infinite
SEED_RANGE = (-(2**63), 2**63 - 1 - 1024)  # torch's generators take 64-bit seeds; room for seed + index


@dataclass
class SamplingParams:
    """How a request's tokens are drawn.

    Args:
        max_tokens: new tokens at most (≥ 1).
        temperature: 0 (or below 1e-5) = greedy; otherwise the logits are divided by it before sampling.
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p`` (1 = all).
        top_k: sample from the ``top_k`` most likely tokens (0 or -1 = all).
        presence_penalty: subtracted from the logit of every token already in the answer ([-2, 2]).
        frequency_penalty: subtracted from a token's logit once per time it is in the answer ([-2, 2]).
        repetition_penalty: a logit of a token in the prompt or the answer is divided by it when positive and
            multiplied by it when negative (1 = off; > 0).
        n: answers drawn for each prompt (each its own request; seeds ``seed``, ``seed + 1``, ...).
        logprobs: with each token, its log-probability and those of the ``logprobs`` most likely tokens
            (0: the token's alone; None: none; at most 20).
        seed: the request's own random seed (None: the engine's seed and the request's number), so a
            request samples the same tokens alone or in any batch.
        stop: strings that end the answer (not included in the text).
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks).

    Every field is checked here: a wrong type or a number out of range (NaN and infinities included)
    raises a ``ValueError`` naming the field.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logprobs: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _whole(self, "max_tokens", low=1)
        _whole(self, "n", low=1)
        _whole(self, "top_k", low=-1)
        if self.logprobs is not None:
            _whole(self, "logprobs", low=0, high=MAX_LOGPROBS)
        if self.seed is not None:
            _whole(self, "seed", low=SEED_RANGE[0], high=SEED_RANGE[1])
        _real(self, "temperature", "≥ 0 (0 = greedy)", lambda v: v >= 0)
        _real(self, "top_p", "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _real(self, "presence_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        _real(self, "frequency_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        _real(self, "repetition_penalty", "> 0 (1 = off)", lambda v: v > 0)
        if not isinstance(self.stop, list | tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is taken (temperature 0, or below what division can take)."""
        return self.temperature < GREEDY_BELOW


def _whole(params: SamplingParams, name: str, low: int | None = None, high: int | None = None) -> None:
    value = getattr(params, name)
    bounds = (f" ≥ {low}" if low is not None else "") + (f" and ≤ {high}" if high is not None else "")
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be a whole number{bounds}, got {value!r}")


def _real(params: SamplingParams, name: str, wanted: str, ok) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a finite number {wanted}, got {value!r}")
    setattr(params, name, float(value))


@dataclass
class TokenLogprob:
    """A drawn token's log-probability under the model and its ``top`` alternatives [(token id, logprob)],
    most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The logits [V] (float32) after the repetition, frequency and presence penalties, as vLLM applies them."""
    if not params.penalized:
        return logits
    logits = logits.clone()
    if params.repetition_penalty != 1:  # float32: an extreme penalty gives ±inf or 0 here, clamped below
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1]).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits.nan_to_num(0.0).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           prompt_ids: list[int] = (), output_ids: list[int] = ()) -> int:
    """One token from next-token logits [V] (float32 math; greedy when the temperature is 0). ``prompt_ids``
    and ``output_ids`` are what the penalties look at."""
    logits = penalize(logits.float(), params, list(prompt_ids), list(output_ids))
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
        drop = before >= params.top_p  # keep the smallest set reaching top_p ...
        drop[..., 0] = False  # ... and always the most likely token (a top_p below float32's range drops nothing else)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def greedy_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int | None], list[bool]]:
    """For logits [R, V]: each row's most likely token where its ``params`` sample greedily without penalties (what
    ``sample`` would draw; None for the other rows), and whether each row holds a NaN, both from one pass: torch's
    ``argmax`` takes NaN for the largest value (its max reductions propagate NaN), so a row holds a NaN exactly where
    the value at its argmax is NaN. (``isnan().any()`` over the logits cost twice the argmax.) On the CPU, float32 logits
    take the compiled ``greedy_rows`` (``csrc/greedy_rows.cpp``: the same tokens and flags, ~10 µs where the argmax takes
    ~110 for a step's 8 rows of 49152)."""
    kernel = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] else None
    if kernel is not None:
        best, has_nan = kernel.greedy_rows(logits)
    else:
        top = logits.argmax(dim=-1)
        best, has_nan = top.tolist(), logits.gather(-1, top[:, None])[:, 0].isnan().tolist()
    greedy = [p.greedy and not p.penalized for p in params]
    return [token if plain else None for token, plain in zip(best, greedy)], has_nan


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the model's logits [V] and the ``top`` most likely tokens'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = [] if best is None else [(int(i), float(v)) for v, i in zip(best.values, best.indices)]
    return TokenLogprob(token, float(logprobs[token]), alternatives)


__all__ = ["MAX_LOGPROBS", "SamplingParams", "TokenLogprob", "greedy_tokens", "penalize", "sample", "token_logprob"]
