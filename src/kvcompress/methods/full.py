"""full: keep every entry (the reference every other method is measured against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Method


@dataclass
class Full(Method):
    """The uncompressed cache. ``budget``/``ratio`` are accepted and ignored, so sweeps can pass them."""

    name: ClassVar[str] = "full"
    paper: ClassVar[str] = "—"
    needs_budget: ClassVar[bool] = False
