"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keep ``sinks`` first tokens plus the ``B − sinks`` most recent (METHODS.md, "StreamingLLM").
While decoding the window rolls: whenever a head exceeds the budget, the oldest non-sink
entries leave (``roll=False`` compresses once at prefill and keeps every later token, as
kvpress's StreamingLLMPress does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import ScoreMethod


@dataclass
class StreamingLLM(ScoreMethod):
    """Attention sinks + a recent window; evicts the oldest entries while decoding (unless ``roll=False``)."""

    sinks: int = 4
    roll: bool = True

    name: ClassVar[str] = "streamingllm"
    paper: ClassVar[str] = "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks"

    def score(self, view, context):
        """Recency: a later position scores higher."""
        return view.positions.float()

    @property
    def acts_while_decoding(self) -> bool:  # type: ignore[override]
        return self.roll
