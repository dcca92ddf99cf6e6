"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling").

SnapKV's scores with per-layer budgets that fall linearly from the first layer to the last,
averaging the budget (METHODS.md, "PyramidKV"); ``pyramid_ratio`` = first ÷ last (default 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV scoring, pyramid-shaped layer budgets."""

    layer_budgets: str = "pyramid"

    name: ClassVar[str] = "pyramidkv"
    paper: ClassVar[str] = "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
