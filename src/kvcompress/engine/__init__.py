"""The serving engine: requests, a scheduler that admits by compressed size, a runner that decodes
every running request in one batched read per layer, and ``LLM`` (the offline API)."""

from .llm import LLM
from .request import RequestOutput
from .sampling import SamplingParams, TokenLogprob

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokenLogprob"]
