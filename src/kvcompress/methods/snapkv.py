"""SnapKV's scorer (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score of entry j: σ_j = Σ_{i∈window} a_ij, the attention the last ``window`` prefill queries
pay to it, averaged over the GQA group and smoothed by 1-D pooling over positions
(METHODS.md, "SnapKV"). The window itself is always kept. The presets ``snapkv``, ``pyramidkv``
(+pyramid), ``adakv`` (+adaptive) and ``momentkv`` (+adaptive, moments) rank with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import attention_probs, group_queries
from .parts import Needs, Scorer
from .selection import pool_scores, recent_mask, sink_mask


@dataclass
class SnapKV(Scorer):
    """Observation-window attention, pooled; keeps the window.

    Options: window (last queries that vote, default 32), kernel (pooling width, 7),
    pooling ("max" or "avg"), plus sinks and chunk_size. Pooling is applied per query head, then
    scores are averaged over the GQA group. While decoding (a policy that evicts: MomentKV) the step's
    query scores the entries, and the most recent ``window`` entries (at most the size) are kept.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    name: ClassVar[str] = "snapkv"
    about: ClassVar[str] = "attention of the prompt's last window queries, pooled (SnapKV)"

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
        window = self._recent(view, torch.full((view.shape[0],), self.window, dtype=torch.long))
        votes = votes.masked_fill(window[:, :, None, :], 0.0)  # the window is kept anyway; it does not vote for itself
        return pool_scores(votes, self.kernel, self.pooling).mean(dim=2)

    @staticmethod
    def _recent(view, count: torch.Tensor) -> torch.Tensor:
        return recent_mask(view.positions, view.valid, count)

    def protected(self, view, context, budgets) -> torch.Tensor:
        count = torch.full((view.shape[0],), self.window, dtype=torch.long)
        return self._recent(view, count) | sink_mask(view.positions, view.valid, self.sinks)

    def decode_score(self, view, context, col_sums) -> torch.Tensor:
        """The step's attention (its column sums, or computed from its query: only when a step evicts)."""
        if col_sums is not None:
            return col_sums
        probs = attention_probs(group_queries(context.query, view.shape[1]), view.keys, context.scaling,
                                context.query_positions, view.positions, view.valid)
        return probs.sum(dim=3).mean(dim=2)

    def decode_protected(self, view, context, budgets) -> torch.Tensor:
        recent = torch.full((view.shape[0],), min(self.window, int(budgets.min())), dtype=torch.long)
        return self._recent(view, recent) | sink_mask(view.positions, view.valid, self.sinks)


__all__ = ["SnapKV"]
