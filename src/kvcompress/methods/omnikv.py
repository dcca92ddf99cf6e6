"""OmniKV (Hao et al. 2025, "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs"), seed 004's baseline.

Dynamic selection without eviction (METHODS.md, "OmniKV"): a few *filter* layers read every
entry; at each filter layer the current query's attention (the largest weight over all query
heads, from that layer's own read: ``read_weights``) picks the ``budget`` (or ``ratio`` ×
context) best tokens, and the layers after it, up to the next filter layer, read only those
tokens (plus the sinks and the most recent ones). The
layers before the first filter layer read everything too. One token set serves every head of
those layers — the paper's observation that important tokens are shared across consecutive
layers. Nothing leaves the cache: kr ≈ 1, cr < 1.

Filter layers: the paper's {2, 8, 18} of 32 layers, scaled to the model's depth
(``round(l · L / 32)``): {2, 8, 17} for the embedded model's 30 layers, {2, 6, 14} for 24.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import cpu_kernels
from .parts import Reads
from .selection import true_columns

STEP = "omnikv_tokens"
BUDGET = "omnikv_budget"  # a filter layer's read budget [B] this step (None: it reads every token)
COLUMNS = "omnikv_columns"  # the last layer's (lengths, positions, columns) this step


@functools.cache
def filter_layers(num_layers: int, reference: tuple[int, ...] = (2, 8, 18), depth: int = 32) -> tuple[int, ...]:
    """The paper's filter layers (for a ``depth``-layer model) scaled to ``num_layers``."""
    return tuple(sorted({min(num_layers - 1, round(layer * num_layers / depth)) for layer in reference}))


@dataclass
class OmniKV(Reads):
    """Filter layers read everything and choose the tokens the next layers read (see the module docstring).

    Options:
        filters: the filter layers (None: the paper's {2, 8, 18} of 32 scaled to the model).
        sinks: first tokens always read (4).
        recent: most recent tokens always read (32).

    The policy's size (or ``read_budget`` / ``read_ratio`` when the policy also evicts) is the tokens the
    layers after a filter layer read per KV head, the sinks and recent ones included.
    """

    filters: tuple[int, ...] | None = None
    sinks: int = 4
    recent: int = 32

    name: ClassVar[str] = "omnikv"
    about: ClassVar[str] = "filter layers choose the tokens the next layers read (OmniKV)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.filters is not None:
            self.filters = tuple(sorted(int(f) for f in self.filters))
            if not self.filters or min(self.filters) < 0:
                raise ValueError(f"filters must be a non-empty list of layer indices, got {self.filters!r}")
        if self.sinks < 0 or self.recent < 1:
            raise ValueError(f"sinks must be ≥ 0 and recent ≥ 1, got {self.sinks}, {self.recent}")

    def filter_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.filters if self.filters is not None else filter_layers(num_layers)

    def layers_read_whole(self, num_layers: int) -> tuple[int, ...]:
        """The layers before the first filter layer and the filter layers: they read every entry."""
        filters = self.filter_layers(num_layers)
        return tuple(sorted({*range(filters[0]), *filters}))

    def select(self, policy, view, context) -> torch.Tensor | None:
        filters = self.filter_layers(context.num_layers)
        layer = context.layer_idx
        if layer < filters[0]:
            return None  # before the first filter layer: everything
        if layer in filters:  # a filter layer reads everything, then chooses for the layers after it (read_weights)
            budget = policy.read_budgets(context)
            context.step[STEP] = None
            context.step[BUDGET] = None if bool((budget >= context.tokens_seen).all()) else budget
            context.step.pop(COLUMNS, None)
            return None
        if context.step.get(STEP) is None:
            return None  # the budget reads every token
        return self.layer_columns(view, context, same_columns=not policy.evicts)

    def wants_read_weights(self, policy, context) -> bool:
        """At a filter layer whose budget does not read every token: its read's weights choose the tokens."""
        return context.layer_idx in self.filter_layers(context.num_layers) and context.step.get(BUDGET) is not None

    def read_weights(self, policy, view, context, weights: torch.Tensor) -> None:
        context.step[STEP] = self.choose(view, context, context.step[BUDGET], weights)

    def layer_columns(self, view, context, same_columns: bool) -> torch.Tensor:
        """``columns`` of the filter layer's choice for this layer. A layer holding the same tokens in the same columns
        as the layer before it reads the same columns: every layer does where nothing is evicted (``same_columns``:
        every token is held in every layer, in the order it came), else where its lengths and positions are the same."""
        held = context.step.get(COLUMNS)
        if held is not None and (same_columns or (torch.equal(held[0], view.lengths) and torch.equal(held[1], view.positions))):
            return held[2]
        columns = self.columns(view, context.step[STEP])
        context.step[COLUMNS] = (view.lengths, view.positions, columns)
        return columns

    def choose(self, view, context, budget: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """bool [B, tokens]: the tokens (by position) the next layers read — the protected ones and the best
        of the rest by the largest attention weight of the step's query (``weights`` [B, H, G, L], the filter
        layer's read's) over every query head, up to the read budget. On the CPU one compiled pass
        (``csrc/omnikv_tokens.cpp``); elsewhere ``chosen_tokens_torch``, the reference."""
        tokens = int(context.tokens_seen.max())
        kernel = cpu_kernels() if weights.device.type == "cpu" else None
        if kernel is None:
            return chosen_tokens_torch(view.positions, view.lengths, budget, weights, self.sinks, self.recent, tokens)
        return kernel.chosen_tokens(weights.float().contiguous(), view.positions, view.lengths.contiguous(), budget.long().cpu(),
                                    self.sinks, self.recent, tokens)

    def columns(self, view, wanted: torch.Tensor) -> torch.Tensor:
        """Indices [B, H, k] of this layer's entries holding the ``wanted`` tokens (bool [B, tokens]) and its
        own protected ones (they differ from the filter layer's when a compressed prompt left each layer
        other tokens), -1 past each head's own count. On the CPU one compiled pass (``csrc/omnikv_tokens.cpp``);
        elsewhere ``token_columns_torch``, the reference."""
        kernel = cpu_kernels() if wanted.device.type == "cpu" else None
        if kernel is None:
            return token_columns_torch(view.positions, view.lengths, wanted, self.sinks, self.recent)
        return kernel.token_columns(wanted.contiguous(), view.positions, view.lengths.contiguous(), self.sinks, self.recent)


def held_and_protected(positions: torch.Tensor, lengths: torch.Tensor, sinks: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, H, L] each, for a view's ``positions`` [B, H, L] and ``lengths`` [B, H]: the columns each head holds,
    and among them its ``sinks`` first and ``recent`` last entries (always read)."""
    columns = torch.arange(positions.shape[2], device=positions.device)
    lengths = lengths.to(positions.device)[..., None]
    held = columns < lengths
    return held, ((columns < sinks) | (columns >= lengths - recent)) & held


def chosen_tokens_torch(positions: torch.Tensor, lengths: torch.Tensor, budget: torch.Tensor, weights: torch.Tensor, sinks: int,
                        recent: int, tokens: int) -> torch.Tensor:
    """``OmniKV.choose`` in plain PyTorch, the reference: bool [B, tokens]."""
    b = positions.shape[0]
    held, protected = held_and_protected(positions, lengths, sinks, recent)
    # an entry's score: its best weight over its query group; protected entries first (+inf), padding never (-inf)
    score = weights.float().amax(dim=2).masked_fill_(~held, -math.inf).masked_fill_(protected, math.inf)
    positions = positions.clamp(max=tokens).reshape(b, -1)  # padding → one spare column, cut below
    # a token's score: its best over every head of the layer (entries hold a token once per head)
    best = torch.full((b, tokens + 1), -math.inf, device=score.device)
    best = best.scatter_reduce_(1, positions, score.reshape(b, -1), reduce="amax")[:, :tokens]
    count = torch.maximum(budget.to(score.device), (best == math.inf).sum(-1))  # every protected token, at least
    top = best.topk(min(int(count.max()), tokens), dim=-1)
    take = (torch.arange(top.indices.shape[-1], device=score.device) < count[:, None]) & (top.values > -math.inf)
    return torch.zeros(b, tokens, dtype=torch.bool, device=score.device).scatter_(1, top.indices, take)


def token_columns_torch(positions: torch.Tensor, lengths: torch.Tensor, wanted: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """``OmniKV.columns`` in plain PyTorch, the reference: int64 [B, H, k]."""
    b, tokens = wanted.shape
    held, protected = held_and_protected(positions, lengths, sinks, recent)
    index = positions.clamp(max=tokens - 1).reshape(b, -1)  # padding: any column (not held)
    read = (wanted.gather(1, index).view(positions.shape) & held) | protected
    return true_columns(read)


__all__ = ["OmniKV", "chosen_tokens_torch", "filter_layers", "token_columns_torch"]
