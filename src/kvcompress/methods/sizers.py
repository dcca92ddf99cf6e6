"""Sizers: how many entries each KV head keeps (METHODS.md, "Budget allocation" and "Threshold sizing").

* ``Uniform``: every head of every layer keeps the size;
* ``Pyramid`` (PyramidKV): layer sizes falling linearly from the first layer to the last, averaging the size;
* ``Adaptive`` (Ada-KV): inside a layer, head h keeps α·B + (1 − α)·c_h, c_h its share of the layer's top H·B;
* ``Global`` (KVzip, the retention gates): one size × layers × KV heads per request, the unprotected entries
  ranked over every layer and head at once;
* ``Threshold`` (DMS-style): each head keeps its protected entries and those scoring at least τ, the size a cap.

While decoding (a policy that evicts), once a head holds more than its size plus the decoding rule's slack, every
head over its size goes back to it (``Global``: a request holding more than its total plus the slack is re-ranked
over every layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..store.view import KVView, LayerContext, LayerInput
from .parts import Sizer
from .selection import PROTECTED_PRIORITY, adaptive_head_budgets, global_sizes, plus_protected, pyramid_layer_budgets



@dataclass
class Uniform(Sizer):
    """Every KV head of every layer keeps the size."""

    name: ClassVar[str] = "uniform"
    about: ClassVar[str] = "every head of every layer keeps the size"


@dataclass
class Pyramid(Sizer):
    """PyramidKV (Cai et al. 2024): layer sizes falling linearly, first ÷ last = ``pyramid_ratio``, mean = the size."""

    pyramid_ratio: float = 4.0

    name: ClassVar[str] = "pyramid"
    about: ClassVar[str] = "layer sizes falling linearly from the first layer to the last (PyramidKV)"

    def __post_init__(self) -> None:
        if not self.pyramid_ratio >= 1.0:
            raise ValueError(f"pyramid_ratio (the first layer's budget over the last's) must be ≥ 1, got {self.pyramid_ratio}")

    def layer_budgets(self, budgets, view, context) -> torch.Tensor:
        per_row = [pyramid_layer_budgets(int(b), context.num_layers, self.pyramid_ratio, int(n))[context.layer_idx]
                   for b, n in zip(budgets.tolist(), context.tokens_seen.tolist())]
        return torch.tensor(per_row, dtype=torch.long)


@dataclass
class Adaptive(Sizer):
    """Ada-KV (Feng et al. 2024): head h of a layer keeps α·B + (1 − α)·c_h, c_h its count in the layer's top H·B."""

    alpha: float = 0.2

    name: ClassVar[str] = "adaptive"
    about: ClassVar[str] = "heads of a layer share its size by their scores (Ada-KV)"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def per_head(self, key, budgets, view, context) -> torch.Tensor:
        return adaptive_head_budgets(key, budgets, self.alpha, view.lengths)


@dataclass
class Global(Sizer):
    """One size × layers × KV heads per request, the unprotected entries ranked over every layer and head at once."""

    name: ClassVar[str] = "global"
    about: ClassVar[str] = "one budget over every layer and head of a request"

    @property
    def plans_globally(self) -> bool:
        return True

    def plan(self, policy, layers: Sequence[LayerInput]) -> list[torch.Tensor]:
        """Per layer [B, H]: how many of each head's unprotected entries are among the request's best."""
        keys, protected = [], torch.zeros(layers[0].context.batch_size, dtype=torch.long)
        budgets = policy.row_budgets(layers[0].context)
        for layer in layers:
            view, context = layer.view, layer.context
            key = policy.ranking(view, context, budgets).key
            keys.append(key)
            protected += (key >= PROTECTED_PRIORITY).sum(dim=(1, 2)).cpu()
        heads = sum(k.shape[1] for k in keys)
        return global_sizes(keys, torch.clamp(budgets * heads - protected, min=0))

    def per_head(self, key, budgets, view, context) -> torch.Tensor:
        raise AssertionError("a global sizer's sizes come from its plan")

    def decode_per_head(self, policy, view: KVView, context: LayerContext, key, budgets: torch.Tensor,
                        slack: int) -> torch.Tensor | None:
        """Every layer at once (rows l·B + b): the requests holding more than their total + ``slack`` re-ranked."""
        if context.layer_idx >= 0:
            return None  # a step cut short before the last layer: the re-rank waits for a whole step
        layers = context.num_layers
        rows = view.shape[0] // layers
        totals = view.lengths.view(layers, rows, -1).sum(dim=(0, 2))  # [B] entries per request
        allowed = budgets.view(layers, rows)[0] * view.shape[1] * layers
        over = totals > allowed + slack
        if not bool(over.any()):
            return None
        ranked = key()
        protected = ranked >= PROTECTED_PRIORITY
        keys = list(ranked.split(rows))
        sizes = global_sizes(keys, torch.clamp(allowed - protected.view(layers, rows, -1).sum(dim=(0, 2)).cpu(), min=0))
        per_head = torch.cat([plus_protected(s, p, n) for s, p, n in zip(sizes, protected.split(rows), view.lengths.split(rows))])
        return torch.where(over.repeat(layers).to(per_head.device)[:, None], per_head, view.lengths.to(per_head.device))


@dataclass
class Threshold(Sizer):
    """Each head of each request keeps its protected entries and those scoring at least ``tau``, at most the
    size (ratio=1.0: no cap), so the entries held follow the content (METHODS.md "Threshold sizing"). τ is on the
    scorer's own scale (KVzip: the most attention a replay query pays an entry). The prompt only: an entry
    that arrives while decoding is kept."""

    tau: float = 0.0

    name: ClassVar[str] = "threshold"
    about: ClassVar[str] = "each head keeps what scores at least tau (DMS-style), the size a cap"

    def __post_init__(self) -> None:
        if isinstance(self.tau, bool) or not isinstance(self.tau, int | float) or not math.isfinite(self.tau):
            raise ValueError(f"threshold: tau must be a finite number (the score an entry needs to stay), got {self.tau!r}")

    def check(self, policy) -> None:
        super().check(policy)
        if policy.decoding.acts:
            raise ValueError(f"{policy.label} evicts to its size while decoding; threshold sizing is for policies that "
                             "compress the prompt once (kvzip, snapkv, expected_attention...)")

    def per_head(self, key, budgets, view, context) -> torch.Tensor:
        protected = (key >= PROTECTED_PRIORITY).sum(dim=-1)
        passing = (key >= self.tau).sum(dim=-1)  # protected keys rank above any threshold
        return torch.minimum(passing, torch.maximum(budgets[:, None].to(key.device), protected))


__all__ = ["Adaptive", "Global", "Pyramid", "Threshold", "Uniform"]
