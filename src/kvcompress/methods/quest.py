"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Dynamic selection: every entry stays held; before each decoding read, each KV head reads only
the pages of ``page_size`` consecutive entries whose keys may score highest for the current
query (METHODS.md, "Quest"). The store keeps, per full page, each key channel's min and max
(computed once, when the page fills; their bytes count in kr). A page's bound,
``Σ_c max(q_c·min_c, q_c·max_c)``, is at least the logit of every key in it; a KV head takes
the best full pages by the largest bound over its group's query heads, up to ``budget`` entries
(or ``ratio`` of the context) per head, on top of the sinks, the most recent entries and the
open page (not yet full), which are always read. Quest saves reads, not memory: kr ≈ 1 (plus
the bounds), cr < 1.

As a read rule it composes with any eviction: ``snapkv:ratio=0.5+quest:read_ratio=0.1`` keeps half the
prompt by SnapKV, then each step reads a tenth of the tokens among what is held (selection over an evicted
or merged cache); an eviction that acts while decoding keeps acting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..read import group_queries, top_pages
from .parts import Needs, Reads


PLAN = "quest_plan"  # the last layer's (lengths, tokens seen, _Plan) this step


@dataclass
class Quest(Reads):
    """Query-aware page selection over every held entry (see the module docstring).

    Options:
        page_size: entries per page (16, the paper's).
        sinks: first entries always read (4).
        recent: most recent entries always read (32), beside the open page (a head's last page while it is not full).
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
        plan = self._plan(view, policy, context)
        if plan is None:
            return None  # every head holds no more than it may read
        query = group_queries(context.query[:, :, -1:], view.shape[1])[:, :, :, 0]  # [B, H, G, d]: the step's (last) query
        return top_pages(query, view.page_bounds, plan.useful, plan.count, plan.protected, plan.open, self.page_size, plan.pages)

    def _plan(self, view, policy, context) -> _Plan | None:
        """What a step's selection takes from the heads' lengths and the read budget alone (None: every head reads all
        it holds), made once a step for every layer whose heads hold as many entries as the last one's (no eviction:
        all)."""
        held = context.step.get(PLAN)
        if held is not None and torch.equal(held[0], view.lengths) and torch.equal(held[1], context.tokens_seen):
            return held[2]
        budget = policy.read_budgets(context)
        plan = None if bool((view.lengths <= budget[:, None]).all()) else self._new_plan(view, budget)
        context.step[PLAN] = (view.lengths, context.tokens_seen, plan)
        return plan

    def _new_plan(self, view, budget: torch.Tensor) -> _Plan:
        b, h, length = view.shape
        size, device = self.page_size, view.positions.device
        lengths = view.lengths.to(device)[..., None]  # [B, H, 1]
        pages = -(-length // size)
        # protected (read anyway): the first `sinks` entries, and from `tail` on the last `recent` and the open page
        sinks = torch.arange(self.sinks, device=device).expand(b, h, -1)
        sinks = sinks.masked_fill(sinks >= lengths, -1)
        tail = torch.minimum(lengths - self.recent, lengths // size * size)
        width = max(self.recent, size - 1)
        recent = lengths - width + torch.arange(width, device=device)
        recent = recent.masked_fill((recent < tail) | (recent < self.sinks), -1)  # sinks already, or before the first
        protected = (sinks >= 0).sum(-1) + (recent >= 0).sum(-1)  # [B, H]
        # a page is worth a bound when it holds an entry that is neither protected nor past the head's end: full pages
        first = torch.arange(pages, device=device) * size
        useful = torch.clamp(first, min=self.sinks) < torch.minimum(first + size, tail)
        # pages in budget: what the protected entries leave, in whole pages (at least one)
        count = torch.clamp((budget.to(device)[:, None] - protected).clamp(min=0) // size, min=1)
        columns = torch.arange(pages * size, device=device)
        return _Plan(torch.cat([sinks, recent], dim=-1), useful, min(int(count.max()), pages), count,
                     (columns >= self.sinks) & (columns < tail))


@dataclass
class _Plan:
    """A step's selection before the query (``read.top_pages``'s arguments): the protected columns [B, H, sinks + tail]
    (-1: none), the pages worth a bound [B, H, P], how many of the best pages are laid out (``pages``) and how many
    each head may take (``count`` [B, H]), and the columns that are neither protected nor past a head's end
    [B, H, P · page_size]."""

    protected: torch.Tensor
    useful: torch.Tensor
    pages: int
    count: torch.Tensor
    open: torch.Tensor


__all__ = ["Quest"]
