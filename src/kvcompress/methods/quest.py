"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Dynamic selection: every entry stays held; before each decoding read, each KV head reads only
the pages of ``page_size`` consecutive entries whose keys may score highest for the current
query (METHODS.md, "Quest"). The store keeps, per page, each key channel's min and max (it
refreshes them for the pages an append touches; their bytes count in kr). A page's bound,
``Σ_c max(q_c·min_c, q_c·max_c)``, is at least the logit of every key in it; a KV head takes
the best pages by the largest bound over its group's query heads, up to ``budget`` entries
(or ``ratio`` of the context) per head, on top of the sinks and the most recent entries,
which are always read. Quest saves reads, not memory: kr ≈ 1 (plus the bounds), cr < 1.

As a read rule it composes with any eviction: ``snapkv:ratio=0.5+quest:read_ratio=0.1`` keeps half the
prompt by SnapKV, then each step reads a tenth of the tokens among what is held (selection over an evicted
or merged cache); an eviction that acts while decoding keeps acting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import group_queries
from .parts import Needs, Reads


def page_bounds(query: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q·k over each page, [B, H, G, pages]: Σ_c max(q_c·min_c, q_c·max_c) for grouped
    queries [B, H, G, d] and page bounds [B, H, pages, 2, d] (min, max per channel)."""
    q = query.float()
    low, high = bounds.float().unbind(dim=3)  # [B, H, pages, d] each
    # max(q_c·min_c, q_c·max_c) = max(q_c, 0)·max_c + min(q_c, 0)·min_c (min_c ≤ max_c): two products, no [.., 2, d] tensor
    return q.clamp(min=0) @ high.transpose(-1, -2) + q.clamp(max=0) @ low.transpose(-1, -2)


@dataclass
class Quest(Reads):
    """Query-aware page selection over every held entry (see the module docstring).

    Options:
        page_size: entries per page (16, the paper's).
        sinks: first entries always read (4).
        recent: most recent entries always read (the current page and the ones before, 32).
        dense_layers: the first layers read everything (2: the paper leaves its first two layers
            dense, where attention is least sparse).
        read_budget / read_ratio: the entries read per step and KV head, protected ones included, when the
            policy's own size is what its scorer keeps; otherwise the policy's size is what is read.
    """

    page_size: int = 16
    sinks: int = 4
    recent: int = 32
    dense_layers: int = 2

    name: ClassVar[str] = "quest"
    about: ClassVar[str] = "each step reads the pages whose key bounds score highest (Quest)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size < 1 or self.sinks < 0 or self.recent < 1 or self.dense_layers < 0:
            raise ValueError(f"page_size and recent must be ≥ 1, sinks and dense_layers ≥ 0, got {self.page_size}, "
                             f"{self.recent}, {self.sinks}, {self.dense_layers}")

    def needs(self) -> Needs:
        return Needs(key_pages=self.page_size)

    def select(self, policy, view, context) -> torch.Tensor | None:
        """The sinks, the recent entries and the best pages by bound, up to the read budget per head."""
        if context.layer_idx < self.dense_layers:
            return None
        b, h, length = view.shape
        size = self.page_size
        budget = policy.read_budgets(context)
        if bool((view.lengths <= budget[:, None]).all()):
            return None  # every head holds no more than it may read
        device = view.positions.device
        lengths = view.lengths.to(device)[..., None]  # [B, H, 1]
        query = group_queries(context.query[:, :, -1:], h)[:, :, :, 0]  # [B, H, G, d]: the step's (last) query
        bound = page_bounds(query, view.page_bounds).amax(dim=2)  # [B, H, pages]: the group's best
        pages = bound.shape[-1]
        # protected: the first `sinks` entries and the last `recent` of each head (read anyway)
        sinks = torch.arange(self.sinks, device=device).expand(b, h, -1)
        sinks = sinks.masked_fill(sinks >= lengths, -1)
        recent = lengths - self.recent + torch.arange(self.recent, device=device)
        recent = recent.masked_fill(recent < self.sinks, -1)  # those are sinks already, or before the first entry
        protected = (sinks >= 0).sum(-1) + (recent >= 0).sum(-1)  # [B, H]
        # a page is worth a bound when it holds an entry that is neither protected nor past the head's end
        first = torch.arange(pages, device=device) * size
        useful = torch.clamp(first, min=self.sinks) < torch.minimum(first + size, lengths - self.recent)
        bound = bound.masked_fill(~useful, float("-inf"))
        # pages in budget: what the protected entries leave, in whole pages (at least one)
        count = torch.clamp((budget.to(device)[:, None] - protected).clamp(min=0) // size, min=1)
        best, chosen = bound.sort(dim=-1, descending=True, stable=True)  # ties: the earlier page first
        k = int(count.max())
        best, chosen = best[..., :k], chosen[..., :k]  # [B, H, k]
        taken = (torch.arange(chosen.shape[-1], device=device) < count[..., None]) & (best > float("-inf"))
        columns = (chosen[..., None] * size + torch.arange(size, device=device)).flatten(-2)  # [B, H, k · size]
        inside = taken.repeat_interleave(size, dim=-1) & (columns >= self.sinks) & (columns < lengths - self.recent)
        return torch.cat([sinks, recent, columns.masked_fill(~inside, -1)], dim=-1)


__all__ = ["Quest", "page_bounds"]
