"""Sampling parameters of a request and the sampler: greedy, temperature, top-p, a seed per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How a request's tokens are drawn.

    Args:
        max_tokens: new tokens at most (≥ 1).
        temperature: 0 = greedy; otherwise the logits are divided by it before sampling.
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p`` (1 = all).
        seed: the request's own random seed (None: the engine's seed and the request's number), so a
            request samples the same tokens alone or in any batch.
        stop: strings that end the answer (not included in the text).
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a whole number ≥ 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be a whole number or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from next-token logits [V] (float32 math; greedy when the temperature is 0)."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
        ordered = ordered.masked_fill(before >= params.top_p, 0.0)  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


__all__ = ["SamplingParams", "sample"]
