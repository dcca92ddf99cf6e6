"""How an entry is stored in a slot: the codec hook of the slot pool.

A codec names the per-slot arrays it needs (``fields``), turns keys and values into them
(``encode``) and back (``decode``, on read: only the slots read are decoded). The read path
and the methods only ever see decoded keys and values, so coded storage (KIVI, DeltaKV)
plugs in here without special cases elsewhere. ``PlainCodec`` stores keys and values as
they are.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Codec(Protocol):
    name: str

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot arrays: name → (shape of one slot's row, dtype)."""
        ...

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows [n, ...] of every field for n entries (keys, values [n, d])."""
        ...

    def decode(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [..., d] from rows [..., ...] of every field."""
        ...


class PlainCodec:
    """Keys and values stored as they are (in the pool's dtype)."""

    name = "plain"

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"keys": ((head_dim,), dtype), "values": ((head_dim,), dtype)}

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def decode(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return rows["keys"], rows["values"]


__all__ = ["Codec", "PlainCodec"]
