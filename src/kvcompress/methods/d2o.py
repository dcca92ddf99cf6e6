"""D2O (Wan et al. 2024, "D2O: Dynamic Discriminative Operations for Efficient Generative Inference
of Large Language Models", arXiv 2406.13035; ICLR 2025).

A merging baseline without votes (METHODS.md, "Merging baselines"). Token level: each entry
that leaves is compared with the retained keys by cosine similarity; if its best similarity
u_e reaches a threshold it is merged into that carrier, otherwise it is dropped. The merge is
a convex combination with weights from the similarities, a softmax that includes the
carrier's similarity to itself (1):
w_e = e^{u_e} / (Σ_{e→c} e^{u_e} + e), w_c = e / (Σ_{e→c} e^{u_e} + e),
k_c ← w_c k_c + Σ w_e k_e, v_c ← w_c v_c + Σ w_e v_e. No votes: the merged key's logit is at
most the convex mix of the originals', so attention mass is lost (attention sag).

Threshold: a fixed ``similarity_threshold``, or (None, the default) D2O's moving threshold,
reconstructed as an EMA per batch row of the mean best similarity of each compression's
candidates: τ ← β·τ + (1 − β)·mean u (first compression: τ = mean u), β = threshold_decay.

Simplifications: D2O's layer-level budget allocation (by attention variance) is left out
(budgets are uniform unless PyramidKV/Ada-KV allocations are chosen); candidates,
importance (EMA), sinks and the recent window are KeepKV's, so that only the merge rule
differs at the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .merging import Merge, Merged, d2o_merge

THRESHOLD = "d2o_threshold"  # per batch row [B] float32 (NaN: no candidates yet)


@dataclass
class D2O(Merge):
    """Similarity-thresholded, similarity-weighted convex merge of keys and values; no votes.

    Options: threshold_decay (β of the moving threshold, 0.9), plus Merge's similarity_threshold (a
    fixed threshold instead of the moving one) and window.
    """

    threshold_decay: float = 0.9

    name: ClassVar[str] = "d2o"
    about: ClassVar[str] = "similarity-weighted convex merge above a moving threshold, no votes (D2O)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.threshold_decay < 1.0:
            raise ValueError(f"threshold_decay must be in [0, 1), got {self.threshold_decay}")

    def accept(self, context, similarity, candidates, state) -> torch.Tensor:
        if self.similarity_threshold is not None:
            return super().accept(context, similarity, candidates, state)
        found = candidates & torch.isfinite(similarity)
        count = found.sum(dim=(1, 2))
        step_mean = torch.where(found, similarity, torch.zeros_like(similarity)).sum(dim=(1, 2)) / count.clamp(min=1)
        previous = context.state.get(THRESHOLD)  # [B] float32, NaN before a row's first candidates
        if previous is None:
            previous = torch.full_like(step_mean, float("nan"))
        moved = torch.where(torch.isnan(previous), step_mean, self.threshold_decay * previous + (1 - self.threshold_decay) * step_mean)
        thresholds = torch.where(count > 0, moved, previous)
        state[THRESHOLD] = thresholds
        return candidates & (similarity >= thresholds.nan_to_num(0.0)[:, None, None])

    def merge_rule(self, view, plan, ref, scaling) -> Merged:
        return d2o_merge(view.keys, view.values, plan)


__all__ = ["D2O"]
