"""KIVI: every entry kept, stored as 2- or 4-bit codes (Liu et al., 2024; METHODS.md "KIVI")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..store.codecs import KiviCodec
from .parts import Storage


@dataclass
class KIVI(Storage):
    """KIVI: keys quantized per channel over groups of ``group_size`` entries, values per entry over
    groups of ``group_size`` channels, ``bits`` each, asymmetric (METHODS.md "KIVI"); each head's
    ``residual`` newest entries stay in full precision (KIVI's residual: new tokens are coded a
    block at a time once more than ``residual`` are plain). Nothing is evicted: kr falls with the
    bits, cr stays 1. As another policy's storage (``snapkv+kivi:bits=4``), what that policy keeps
    is stored this way.

    Args:
        bits: 2 or 4 per number (2, the paper's headline).
        group_size: entries per key group and channels per value group (32, the paper's).
        residual: newest entries per head kept plain (128, the paper's).
    """

    bits: int = 2
    group_size: int = 32
    residual: int = 128

    name: ClassVar[str] = "kivi"
    about: ClassVar[str] = "2- or 4-bit codes, keys per channel and values per token (KIVI)"
    sizes_itself: ClassVar[str] = "it keeps every entry, and its bits set the bytes held"

    def __post_init__(self) -> None:
        if not isinstance(self.residual, int) or isinstance(self.residual, bool) or self.residual < 0:
            raise ValueError(f"kivi's residual must be a whole number of entries ≥ 0, got {self.residual!r}")
        self.storage(torch.float32)[0].check_block()  # checks bits and group_size

    def storage(self, dtype: torch.dtype, read_whole: tuple[int, ...] = ()) -> tuple[KiviCodec, int]:
        """KIVI's codec (zero points and scales in bfloat16 for a bf16 model, else float16) and its residual (the
        read dequantises in place, so layers read whole are coded too)."""
        param_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        return KiviCodec(self.bits, self.group_size, param_dtype), self.residual
