"""full: keep every entry (the reference every other method is measured against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Method


@dataclass
class Full(Method):
    """The uncompressed cache (it takes no size)."""

    name: ClassVar[str] = "full"
    paper: ClassVar[str] = "—"
    needs_budget: ClassVar[bool] = False
    keeps_every_entry: ClassVar[bool] = True
    sizes_itself: ClassVar[str] = "it keeps every entry"
