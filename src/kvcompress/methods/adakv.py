"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation").

SnapKV's scores with head-wise budgets inside each layer (METHODS.md, "Ada-KV"): the global
top H·B entries of the layer are counted per head (c_h) and head h keeps
b_h = α·B + (1 − α)·c_h entries, α = 0.2. Heads then really hold different numbers of
entries (the cache stores them ragged; kr counts what is held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .snapkv import SnapKV


@dataclass
class AdaKV(SnapKV):
    """SnapKV scoring, adaptive head-wise budgets."""

    head_budgets: str = "adaptive"

    name: ClassVar[str] = "adakv"
    paper: ClassVar[str] = "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"
