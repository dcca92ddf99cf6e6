"""KIVI: every entry kept, stored as 2- or 4-bit codes (Liu et al., 2024; METHODS.md "KIVI")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..store.codecs import KiviCodec
from .base import Method


@dataclass
class KIVI(Method):
    """KIVI: keys quantized per channel over groups of ``group_size`` entries, values per entry over
    groups of ``group_size`` channels, ``bits`` each, asymmetric (METHODS.md "KIVI"); each head's
    ``residual`` newest entries stay in full precision (KIVI's residual: new tokens are coded a
    block at a time once more than ``residual`` are plain). Nothing is evicted: kr falls with the
    bits, cr stays 1. As another method's ``codec`` (``snapkv:codec="kivi:bits=4"``), what that
    method keeps is stored this way.

    Args:
        bits: 2 or 4 per number (2, the paper's headline).
        group_size: entries per key group and channels per value group (32, the paper's).
        residual: newest entries per head kept plain (128, the paper's).

    It takes no ``budget``/``ratio``: the bits set its size.
    """

    bits: int = 2
    group_size: int = 32
    residual: int = 128

    name: ClassVar[str] = "kivi"
    paper: ClassVar[str] = "Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
    needs_budget: ClassVar[bool] = False
    keeps_every_entry: ClassVar[bool] = True
    sizes_itself: ClassVar[str] = "it keeps every entry, and its bits set the bytes held"

    def __post_init__(self) -> None:
        if self.codec is not None:
            raise ValueError("kivi is a codec itself: give its options directly (kivi:bits=4), not codec=")
        super().__post_init__()  # refuses a size
        if not isinstance(self.residual, int) or isinstance(self.residual, bool) or self.residual < 0:
            raise ValueError(f"kivi's residual must be a whole number of entries ≥ 0, got {self.residual!r}")
        self.storage()  # checks bits and group_size

    def storage(self, dtype: torch.dtype = torch.float32) -> tuple[KiviCodec, int]:
        """KIVI's codec (zero points and scales in bfloat16 for a bf16 model, else float16) and its residual."""
        param_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        return KiviCodec(self.bits, self.group_size, param_dtype), self.residual
