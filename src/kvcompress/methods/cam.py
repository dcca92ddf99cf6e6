"""CaM (Zhang et al. 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024).

A merging baseline without votes (METHODS.md, "Merging baselines"): an entry that leaves
has its value folded into a retained entry's value, weighted by attention; the carrier
keeps its key. For the reference query q̄ the group {carrier} ∪ {candidates} becomes
v_c = Σ e^{λ_i} v_i / Σ e^{λ_i} (λ_i = τ·q̄ᵀk_i) under the carrier's single logit λ_c, so the
candidates' attention mass e^{λ_e} is lost: the output is biased toward the group and the
softmax loses mass ("attention sag" in the KeepKV paper's terms).

Simplifications, so that only the merge rule differs from KeepKV at the same budget: the
paper evicts by H2O's accumulated attention and merges into the following retained tokens
with a Bernoulli draw whose probability is the evicted token's attention relative to the
carriers'; here candidates, importance (EMA), sinks, the recent window and the carrier (most
cosine-similar retained key) are KeepKV's, and the merge is deterministic (its expectation,
every candidate merged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .merging import Merge, Merged, cam_merge


@dataclass
class CaM(Merge):
    """Attention-weighted value merge into the most similar retained key; keys and logits unchanged, no votes."""

    name: ClassVar[str] = "cam"
    about: ClassVar[str] = "merge what leaves into the carrier's value by attention, no votes (CaM)"

    def merge_rule(self, view, plan, ref, scaling) -> Merged:
        return cam_merge(view.keys, view.values, ref.logits(view.keys, scaling), plan)


__all__ = ["CaM"]
