"""H2O's scorer (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs").

Score σ_j = Σ_i a_ij, the attention every query so far paid to entry j (mean over the GQA
group); keep the top B − R by score plus the R most recent (METHODS.md, "H2O"). While
decoding each new query's weights are added to σ; the ``h2o`` preset evicts the lowest entries
whenever a head holds more than the budget, so the cache never grows past it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .parts import Needs, Scorer
from .selection import recent_mask, sink_mask

SCORE = "h2o_score"


@dataclass
class H2O(Scorer):
    """Accumulated attention (heavy hitters) + a recent window.

    Options: recent_ratio (share R/B of the budget given to the most recent tokens, 0.5 as in the
    paper's equal split), plus sinks and chunk_size.
    """

    recent_ratio: float = 0.5

    name: ClassVar[str] = "h2o"
    about: ClassVar[str] = "attention accumulated over every query so far, plus a recent window (H2O)"
    channels: ClassVar[tuple[str, ...]] = (SCORE,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def needs(self) -> Needs:
        return Needs(attention_sums=True)

    def prepare(self, view, context) -> None:
        view.channels[SCORE] = context.observations["attention_sums"]  # the prefill's sums become the running score

    def score(self, view, context) -> torch.Tensor:
        return view.channels[SCORE]

    def protected(self, view, context, budgets) -> torch.Tensor:
        recent = (budgets.double() * self.recent_ratio).round().long()
        return recent_mask(view.positions, view.valid, recent) | sink_mask(view.positions, view.valid, self.sinks)

    def wants_col_sums(self, context) -> bool:
        return True

    def observe_step(self, view, context, col_sums) -> None:
        view.channels[SCORE] = view.channels[SCORE] + col_sums  # this step's attention, mean over the group


__all__ = ["H2O", "SCORE"]
