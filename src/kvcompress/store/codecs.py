"""How entries are stored: the codec hook of the slot pool.

A codec stores entries in blocks of ``block_size`` entries of one KV head (1 for plain
storage): it names the per-block arrays it needs (``fields``), turns keys and values into
them (``encode``) and decodes single entries back (``decode``, on read: only the entries
read are decoded). The read path and the methods only ever see decoded keys and values,
so coded storage plugs in here without special cases elsewhere.

* ``PlainCodec``: keys and values as they are (blocks of one entry).
* ``KiviCodec``: KIVI (Liu et al., 2024; METHODS.md "KIVI"): keys quantized per channel over
  a block of ``group_size`` entries, values per entry over groups of ``group_size`` channels,
  ``bits`` = 2 or 4, asymmetric (a zero point and a scale per group, stored as 16-bit
  floats). Codes are packed ``8 / bits`` to a byte.
* DeltaKV's codec (``store/deltakv.py``): a block is one token over every KV head, coded against
  its nearest reference tokens; it codes tokens itself (``code_rows``) and keeps its references
  in a tier of their own.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from .view import KiviBlocks

Fields = dict[str, tuple[tuple[int, ...], torch.dtype]]


def field_bytes(fields: Fields) -> int:
    """Bytes of one slot (or block) with a codec's ``fields``."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt in fields.values())


class Codec(Protocol):
    """What the pool asks of a codec. A codec that codes a token over every KV head at once (DeltaKV)
    has no ``encode``: it codes a table's entries itself (``code_rows``), may make tiers of its own
    when its tier is made (``attach``) and name what a freed block held (``dependencies``). A codec a decoding read can
    read where it lives has ``in_place(pool, tier)``: the tiers that read covers and a function giving their blocks
    (``store.view.KiviBlocks``, ``DeltaKVBlocks``), or None where it cannot."""

    name: str
    key: str  # codecs with the same key store entries the same way (they share a pool tier)
    block_size: int  # entries per block
    chunk: int  # new entries per head between two coding passes while decoding

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        """Per-block arrays: name → (shape of one block's row, dtype)."""
        ...

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> float:
        """Pool bytes one coded entry (a KV head at a token of a layer) takes on average, whatever it shares
        (a block, references) counted (the engine admits requests by it)."""
        ...

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows [n, ...] of every field for n blocks (keys, values [n, block_size, d], or [n, d] for blocks of one)."""
        ...

    def decode(self, arrays: dict[str, torch.Tensor], entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, d] of ``entries`` [n] (int64: block · block_size + offset in the block)."""
        ...


class PlainCodec:
    """Keys and values stored as they are (in the pool's dtype), one entry per block."""

    name = key = "plain"
    block_size = chunk = 1

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        return {"keys": ((head_dim,), dtype), "values": ((head_dim,), dtype)}

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> float:
        return field_bytes(self.fields(head_dim, dtype))

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def decode(self, arrays, entries):
        return arrays["keys"].index_select(0, entries), arrays["values"].index_select(0, entries)


class KiviCodec:
    """KIVI's asymmetric quantization (see the module docstring).

    Per group of numbers x: zero point z = min x and scale s = (max x − z) / (2^bits − 1), both
    rounded to 16-bit floats so that every x stays inside [z, z + (2^bits − 1)·s]; code
    c = round((x − z) / s); x̂ = z + c·s, so |x − x̂| ≤ s / 2. Keys group per channel over the
    block's ``group_size`` entries (outlier channels keep their own scale), values per entry
    over ``group_size`` channels (fewer when the head is smaller).

    Args:
        bits: 2 or 4.
        group_size: entries per key group (a block) and channels per value group (32, the paper's).
        param_dtype: of the zero points and scales (float16; bfloat16 for bf16 models).
    """

    name = "kivi"

    def __init__(self, bits: int = 2, group_size: int = 32, param_dtype: torch.dtype = torch.float16):
        if bits not in (2, 4):
            raise ValueError(f"kivi stores 2 or 4 bits per number, got bits={bits!r}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"kivi's group_size must be a positive whole number, got {group_size!r}")
        self.bits, self.group_size, self.param_dtype = bits, group_size, param_dtype
        self.block_size = group_size

    @property
    def key(self) -> str:
        """Codecs with the same key store entries the same way (they share a pool tier)."""
        return f"kivi:{self.bits}:{self.group_size}:{self.param_dtype}"

    @property
    def chunk(self) -> int:
        """New entries per head between two coding passes while decoding: a block's worth."""
        return self.block_size

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    def in_place(self, pool, tier: int):
        """How a decoding read reads this tier where it lives: the tiers it covers, and a function giving its blocks."""
        return {tier}, lambda: KiviBlocks(tier, self, pool.tiers[tier - 1].arrays)

    def channel_group(self, head_dim: int) -> int:
        """Channels per value group: ``group_size``, or the whole head when it does not divide."""
        return self.group_size if head_dim % self.group_size == 0 else head_dim

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        if head_dim * self.bits % 8:
            raise ValueError(f"kivi packs {8 // self.bits} codes to a byte: head_dim {head_dim} does not divide")
        self.check_block()
        packed, g, p = head_dim * self.bits // 8, self.block_size, self.param_dtype
        value_groups = head_dim // self.channel_group(head_dim)
        return {  # key codes channel by channel across the block's entries: a block's logits in one pass over the channels
            "key_codes": ((head_dim, g * self.bits // 8), torch.uint8), "key_zero": ((head_dim,), p), "key_scale": ((head_dim,), p),
            "value_codes": ((g, packed), torch.uint8), "value_zero": ((g, value_groups), p), "value_scale": ((g, value_groups), p),
        }

    def check_block(self) -> None:
        """A block's codes of a key channel fill whole bytes (group_size a multiple of 8 / bits)."""
        if self.block_size * self.bits % 8:
            raise ValueError(f"kivi packs a channel's {self.bits}-bit key codes of a block into whole bytes: group_size must "
                             f"be a multiple of {8 // self.bits}, got {self.block_size}")

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> float:
        return field_bytes(self.fields(head_dim, dtype)) / self.block_size

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        self.check_block()
        n, g, d = keys.shape
        key_codes, key_zero, key_scale = self.quantize(keys.float(), dim=1)  # per channel over the block's entries
        c = self.channel_group(d)
        grouped = values.float().view(n, g, d // c, c)
        value_codes, value_zero, value_scale = self.quantize(grouped, dim=3)  # per entry over channel groups
        return {
            "key_codes": pack(key_codes.transpose(1, 2).contiguous(), self.bits), "key_zero": key_zero.squeeze(1), "key_scale": key_scale.squeeze(1),
            "value_codes": pack(value_codes.view(n, g, d), self.bits),
            "value_zero": value_zero.squeeze(3), "value_scale": value_scale.squeeze(3),
        }

    def quantize(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes (uint8, x's shape), zero points and scales (``param_dtype``, x's shape with ``dim`` kept as 1)
        of float32 ``x``, grouped along ``dim``."""
        low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        zero = _round_down(low, self.param_dtype)
        scale = _round_up((high - zero.float()) / self.levels, self.param_dtype)
        step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((x - zero.float()) / step).clamp_(0, self.levels).to(torch.uint8)
        return codes, zero, scale

    def decode(self, arrays, entries):
        blocks = entries // self.block_size

        def rows(name: str) -> torch.Tensor:  # one row per entry of a per-entry field [blocks, G, ...]
            array = arrays[name]
            return array.view(-1, *array.shape[2:]).index_select(0, entries)

        offsets, per = entries % self.block_size, 8 // self.bits
        key_bytes = arrays["key_codes"][blocks, :, offsets // per]  # [n, d]: each channel's byte holding the entry
        key_codes = ((key_bytes >> ((offsets % per) * self.bits).to(torch.uint8)[:, None]) & self.levels).float()
        keys = torch.addcmul(arrays["key_zero"].index_select(0, blocks).float(), key_codes,
                             arrays["key_scale"].index_select(0, blocks).float())
        value_codes = unpack(rows("value_codes"), self.bits, torch.float32)
        n, d = value_codes.shape
        c = self.channel_group(d)
        values = torch.addcmul(rows("value_zero").float()[..., None], value_codes.view(n, d // c, c),
                               rows("value_scale").float()[..., None])
        return keys, values.view(n, d)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] (each < 2^bits) → bytes [..., d·bits/8], the first code in the lowest bits."""
    per = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The inverse of ``pack``: bytes [..., m] → codes [..., m·8/bits] in ``dtype`` (byte-wise shifts: no
    widening before the last step, the fastest form on a CPU)."""
    mask = 2**bits - 1
    codes = torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)], dim=-1)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * (8 // bits)).to(dtype)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` in ``dtype``, never above ``x``."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` in ``dtype``, never below ``x``."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


__all__ = ["Codec", "KiviCodec", "PlainCodec", "pack", "unpack"]
