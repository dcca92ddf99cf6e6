"""The merging methods' scorer: an exponential moving average of the attention each entry receives
(KeepKV, Algorithm 1 step 4; shared by the ``keepkv``, ``cam`` and ``d2o`` presets, METHODS.md "KeepKV").

At the prefill, S_i is the EMA of the observation window's attention (mean over the GQA group), bias-corrected
(Ŝ_i = S_i / (1 − α^{n_i})) and SnapKV-pooled for the selection; while decoding every step's attention (votes
included) is folded in, and an eviction ranks by Ŝ unpooled. Sinks and the most recent tokens are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import attention_probs, group_queries
from ..read.reference import masked_logits
from ..store.view import KVView
from .parts import Needs, Scorer
from .selection import pool_scores, recent_mask, sink_mask

EMA = "merge_ema"  # channel: the EMA of the attention an entry received, S_i (not bias-corrected)
EMA_NORM = "merge_ema_norm"  # channel: the EMA of ones over the same updates, 1 − α^{n_i} (bias correction)


def ema_over_queries(
    s: torch.Tensor, norm: torch.Tensor, probs: torch.Tensor, query_positions: torch.Tensor,
    key_positions: torch.Tensor, key_valid: torch.Tensor | None, decay: float, query_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold each query's attention (probs [B, H, q, L], mean over the group) into the EMA, in order:
    S ← αS + (1 − α)a for every query that sees an entry, and the bias-correction weight alike.

    An entry is updated only by queries that see it (causality by position, real queries), so
    every entry's bias correction 1 − α^{n_i} counts its own updates. The q steps are summed in
    closed form: queries come in position order and padding queries before real ones (a
    left-padded row), so once a query sees an entry every later one does, and query j's term is
    (1 − α)·α^{q−1−j}·a_j while the old S decays by α^{n_i}.
    """
    visible = key_positions[:, :, None, :] <= query_positions[:, None, :, None]  # [B, H, q, L]
    if key_valid is not None:
        visible = visible & key_valid[:, :, None, :]
    if query_valid is not None:
        visible = visible & query_valid.to(visible.device)[:, None, :, None]
    q = probs.shape[2]
    if q == 1:  # a decoding step: S ← αS + (1 − α)a where the query sees the entry, in a few operations
        seen = visible[:, :, 0]
        return (torch.where(seen, torch.lerp(probs[:, :, 0].float(), s, decay), s),
                torch.where(seen, torch.lerp(torch.ones_like(norm), norm, decay), norm))
    weight = (1 - decay) * decay ** torch.arange(q - 1, -1, -1, dtype=torch.float32, device=probs.device)  # [q]
    kept = torch.pow(decay, visible.sum(2, dtype=torch.float32))  # α^{n_i}
    fresh = (probs.float() * visible).transpose(2, 3) @ weight  # Σ_j (1 − α)·α^{q−1−j}·a_ij over visible j
    return s * kept + fresh, norm * kept + (1 - kept)


def window_query_valid(queries: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, w] bool: which of the last w prefill queries are real tokens (rows are left-padded)."""
    w = queries.shape[2]
    column = torch.arange(w, device=queries.device)
    return column[None, :] >= (w - tokens.to(queries.device))[:, None]


def prefill_window(context, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill's last ``window`` queries [B, Hq, w, d], their positions [B, w] and which are real [B, w]."""
    queries = context.observations["window_queries"][:, :, -window:]
    return queries, context.observations["window_positions"][:, -window:], window_query_valid(queries, context.tokens_seen)


@dataclass
class EMAImportance(Scorer):
    """Bias-corrected EMA of the attention each entry receives; sinks and a recent window kept.

    Options: window (the prefill queries the EMA starts from, 32), kernel and pooling (SnapKV's smoothing of
    the prefill's scores), sinks (4, METHODS.md's s), recent (most recent tokens kept; None = the window;
    capped at half of what the sinks leave of the size, so that merging methods find carriers), ema_decay (α
    of S_i ← αS_i + (1 − α)a_i; 0.9, a memory of about 10 queries, shorter than the 32-query window, as the
    locality argument asks; the paper's value is lost in the text).
    """

    sinks: int = 4
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    recent: int | None = None
    ema_decay: float = 0.9

    name: ClassVar[str] = "ema"
    about: ClassVar[str] = "moving average of the attention each entry receives (KeepKV's importance)"
    channels: ClassVar[tuple[str, ...]] = (EMA, EMA_NORM)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.pooling not in ("max", "avg"):
            raise ValueError(f"ema: window and kernel must be ≥ 1 and pooling 'max' or 'avg', got {self.window}, "
                             f"{self.kernel}, {self.pooling!r}")
        if not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.recent is not None and self.recent < 0:
            raise ValueError("recent must be ≥ 0")

    def needs(self) -> Needs:
        return Needs(window=self.window)

    @property
    def always_kept(self) -> int:
        return self.window + self.sinks

    # ----- the prefill -------------------------------------------------------------------------
    def prepare(self, view, context) -> None:
        self.start_from(view, *prefill_window(context, self.window), context.scaling)

    def start_from(self, view: KVView, queries, query_positions, query_valid, scaling) -> None:
        """EMA channels of the window queries' attention (mean over the group) (Alg. 1, step 4)."""
        grouped = group_queries(queries, view.shape[1])
        probs = attention_probs(grouped, view.keys, scaling, query_positions, view.positions, view.valid).mean(dim=2)
        zeros = torch.zeros(view.shape, dtype=torch.float32, device=view.keys.device)
        s, norm = ema_over_queries(zeros, zeros, probs, query_positions, view.positions, view.valid, self.ema_decay, query_valid)
        view.channels.update({EMA: s, EMA_NORM: norm})

    @staticmethod
    def importance(view: KVView) -> torch.Tensor:
        """Bias-corrected EMA Ŝ_i = S_i / (1 − α^{n_i}) [B, H, L] (0 before any update)."""
        s, norm = view.channels[EMA], view.channels[EMA_NORM]
        return torch.where(norm > 0, s / norm.clamp(min=1e-30), torch.zeros_like(s))

    def score(self, view, context) -> torch.Tensor:
        return pool_scores(self.importance(view), self.kernel, self.pooling)

    def recent_count(self, budgets: torch.Tensor) -> torch.Tensor:
        """[B]: protected recent tokens per row."""
        recent = self.window if self.recent is None else self.recent
        return torch.clamp(torch.minimum(torch.full_like(budgets, recent), (budgets - self.sinks) // 2), min=0)

    def protected(self, view, context, budgets) -> torch.Tensor:
        return recent_mask(view.positions, view.valid, self.recent_count(budgets)) | sink_mask(view.positions, view.valid, self.sinks)

    # ----- decoding ----------------------------------------------------------------------------
    def wants_col_sums(self, context) -> bool:
        return context.query.shape[2] == 1  # several queries at once: their weights are taken one by one

    def step_weights(self, view, context, col_sums) -> torch.Tensor:
        """Each query's attention [B, H, q, L] (votes included, mean over the group), in order."""
        if col_sums is not None:
            return col_sums[:, :, None]
        grouped = group_queries(context.query, view.shape[1])
        logits = masked_logits(grouped, view.keys, context.scaling, context.query_positions, view.positions, view.valid,
                               view.log_weights)
        return torch.nan_to_num(torch.softmax(logits, dim=-1)).mean(dim=2)

    def observe_step(self, view, context, col_sums) -> None:
        """Fold the step's attention into every entry's EMA (in the view's working channels)."""
        s, norm = ema_over_queries(view.channels[EMA], view.channels[EMA_NORM], self.step_weights(view, context, col_sums),
                                   context.query_positions, view.positions, view.valid, self.ema_decay)
        view.channels.update({EMA: s, EMA_NORM: norm})

    def decode_score(self, view, context, col_sums) -> torch.Tensor:
        return self.importance(view)


__all__ = ["EMA", "EMA_NORM", "EMAImportance", "ema_over_queries", "prefill_window", "window_query_valid"]
