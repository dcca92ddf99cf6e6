"""``Drop``: the entries that leave are forgotten (every eviction method's fate; merges and moments are in
merging.py and momentkv.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..store.view import Edit
from .parts import Fate
from .selection import top_per_head


@dataclass
class Drop(Fate):
    """Keep each head's best ``per_head`` entries by the ranking key; forget the rest."""

    name: ClassVar[str] = "drop"
    about: ClassVar[str] = "what leaves is forgotten"

    def evict(self, policy, view, context, ranking, per_head, budgets) -> Edit:
        return Edit(keep=top_per_head(ranking.key, per_head))

    def decode_evict(self, policy, view, context, col_sums, key, per_head, budgets) -> Edit:
        return Edit(keep=top_per_head(key(), per_head))


__all__ = ["Drop"]
