"""A size turned into entries: the one place a ``budget`` or a ``ratio`` becomes a count, with one rounding rule.

Every part that needs a count (the sizers at the prefill, eviction while decoding, the entries Quest and
OmniKV read per step) asks ``Budget.entries``: a budget is that many entries per KV head; a ratio r keeps
⌊r × tokens seen⌋ of a row's tokens per KV head (floored, as kvpress does, so both keep the same number
of entries; at least one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BUDGET = 2**31 - 1  # entries per KV head: a budget must fit the int32 slot tables


@dataclass(frozen=True)
class Budget:
    """Entries per KV head: ``budget`` entries, or ``ratio`` of the tokens seen (exactly one of them)."""

    budget: int | None = None
    ratio: float | None = None

    @staticmethod
    def check(owner: str, budget, ratio) -> Budget:
        """The budget, checked: exactly one of budget (a whole number ≥ 1) and ratio (in (0, 1])."""
        if (budget is None) == (ratio is None):
            raise ValueError(f"{owner}: give exactly one of budget= (entries per KV head) or ratio= (fraction kept).")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ValueError(f"{owner}: budget must be a positive whole number of entries per KV head, got {budget!r}.")
        if budget is not None and budget > MAX_BUDGET:
            raise ValueError(f"{owner}: budget={budget} is beyond any context ({MAX_BUDGET} entries per KV head at "
                             "most); to keep everything use ratio=1.0 or the full method.")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < float(ratio) <= 1.0):
            raise ValueError(f"{owner}: ratio must be in (0, 1] (the fraction of context entries kept), got {ratio!r}.")
        return Budget(budget, None if ratio is None else float(ratio))

    def entries(self, tokens: torch.Tensor) -> torch.Tensor:
        """Entries per KV head for rows that have seen ``tokens`` [B] tokens: [B] int64 (not capped at ``tokens``)."""
        if self.budget is not None:
            return torch.full_like(tokens, self.budget)
        return torch.clamp((tokens.double() * self.ratio + 1e-9).floor().long(), min=1)

    def count(self, tokens: int) -> int:
        """``entries`` for one row of ``tokens`` tokens, capped at ``tokens``."""
        return min(int(self.entries(torch.tensor([tokens]))[0]), tokens)

    @property
    def label(self) -> str:
        """``@budget`` or ``@ratio`` for tables."""
        return f"@{self.budget}" if self.budget is not None else f"@{self.ratio:g}"


__all__ = ["MAX_BUDGET", "Budget"]
