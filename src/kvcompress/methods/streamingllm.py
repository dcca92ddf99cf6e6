"""StreamingLLM's scorer (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Recency: keep ``sinks`` first tokens plus the ``B − sinks`` most recent (METHODS.md, "StreamingLLM").
The ``streamingllm`` preset evicts while decoding, so the window rolls: whenever a head exceeds the
budget the oldest non-sink entries leave (``streamingllm+static`` compresses once at prefill and keeps
every later token, as kvpress's StreamingLLMPress does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .parts import Scorer


@dataclass
class Recency(Scorer):
    """A later position scores higher; the first ``sinks`` tokens (4) are kept."""

    sinks: int = 4

    name: ClassVar[str] = "recency"
    about: ClassVar[str] = "the most recent tokens, plus attention sinks (StreamingLLM)"

    def score(self, view, context):
        return view.positions.float()


__all__ = ["Recency"]
