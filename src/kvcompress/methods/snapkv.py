"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score of entry j: σ_j = Σ_{i∈window} a_ij, the attention the last ``window`` prefill queries
pay to it, averaged over the GQA group and smoothed by 1-D pooling over positions
(METHODS.md, "SnapKV"). The window itself is always kept; the rest of the budget goes to
the top scores. PyramidKV and Ada-KV reuse this score with other budget allocations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import attention_probs, group_queries
from .base import Needs, ScoreMethod, pool_scores, recent_mask, sink_mask


@dataclass
class SnapKV(ScoreMethod):
    """Observation-window attention, pooled; keeps the window.

    Options: window (last queries that vote, default 32), kernel (pooling width, 7),
    pooling ("max" or "avg"), plus ScoreMethod's sinks, chunk_size and budget allocations.
    Pooling is applied per query head, then scores are averaged over the GQA group.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    name: ClassVar[str] = "snapkv"
    paper: ClassVar[str] = "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be ≥ 1, got {self.window}")
        if self.kernel < 1:
            raise ValueError(f"kernel (the pooling width) must be ≥ 1, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be 'max' or 'avg', got {self.pooling!r}")

    def needs(self) -> Needs:
        return Needs(window=self.window)

    @property
    def always_kept(self) -> int:
        return self.window + self.sinks

    def score(self, view, context) -> torch.Tensor:
        queries = context.observations["window_queries"][:, :, -self.window :]
        query_positions = context.observations["window_positions"][:, -self.window :]
        grouped = group_queries(queries, view.shape[1])
        probs = attention_probs(grouped, view.keys, context.scaling, query_positions, view.positions, view.valid)
        votes = probs.sum(dim=3)  # [B, H, G, L]: total attention from the window, per query head
        window = self._window_mask(view)
        votes = votes.masked_fill(window[:, :, None, :], 0.0)  # the window is kept anyway; it does not vote for itself
        return pool_scores(votes, self.kernel, self.pooling).mean(dim=2)

    def _window_mask(self, view) -> torch.Tensor:
        count = torch.full((view.shape[0],), self.window, dtype=torch.long)
        return recent_mask(view.positions, view.valid, count)

    def protected(self, view, context, budgets) -> torch.Tensor:
        return self._window_mask(view) | sink_mask(view.positions, view.valid, self.sinks)
