"""The slot pool: where every KV entry lives, and the slot tables that say which entries a head holds.

* ``SlotPool``: one set of per-slot arrays for every layer and sequence. A slot holds one
  entry — the key and the value of one KV head at one token, stored by a codec — so layers
  and heads may hold any number of entries within one memory budget. Slot 0 is never
  handed out (padded tables point at it). A free list hands out and takes back slots;
  reference counts let forks of a sequence share entries (a slot is free again when its
  last holder lets it go). A fixed pool (``capacity=``, the engine) raises
  ``PoolExhausted`` when full; a growable one (the single-request cache) doubles.
* ``LayerTable``: one layer of a batch of sequences: per (row, KV head) the slots of the
  entries it holds, their positions, optional log-weights and per-entry method channels,
  left-aligned in arrays [B, H, capacity] that grow by doubling. Appending writes only the
  new entries (amortized O(new)); evicting compacts the table and frees the slots; a
  rewrite (a merge) writes new slots and frees the old ones, so a fork never sees another
  fork's changes.

Nothing here knows a method or transformers: edits arrive as ``store.view.Edit``.
"""

from __future__ import annotations

import functools
import math

import torch

from .codecs import Codec, PlainCodec
from .view import PAD_POSITION, UNCHANGED, Edit, Entries, KVView

PAD_SLOT = 0
INDEX_BYTES = 4  # a slot index (int32) per entry
POSITION_BYTES = 4  # an original position (int32) per entry
WEIGHT_BYTES = 4  # a log-weight or a channel value (float32) per entry
LENGTH_BYTES = 8  # an entry count (int64) per head


def _plain_tensors(fn):
    """Run a store operation outside inference mode and autograd, so that what the store creates are
    ordinary tensors: entries written under ``torch.inference_mode`` (a generate call) stay writable
    afterwards (a fork, a release from a finalizer)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled() and not torch.is_grad_enabled():
            return fn(*args, **kwargs)  # already plain (a store operation calling another)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


class PoolExhausted(RuntimeError):
    """A fixed-size pool has fewer free slots than asked for."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"the KV slot pool has {free} free slots, {needed} are needed")
        self.needed, self.free = needed, free


class SlotPool:
    """Per-slot arrays for every entry of every layer and sequence (see the module docstring).

    Args:
        head_dim: d of one key (and value).
        dtype, device: of the stored entries.
        capacity: usable slots of a fixed pool; None = growable (starts at ``initial``).
        codec: how an entry is stored (default: plain keys and values).
    """

    @_plain_tensors
    def __init__(self, head_dim: int, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 capacity: int | None = None, codec: Codec | None = None, initial: int = 4096):
        if capacity is not None and capacity < 1:
            raise ValueError(f"a fixed pool needs at least one slot, got capacity={capacity}")
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.codec = codec or PlainCodec()
        self.fixed = capacity is not None
        self._fields = self.codec.fields(head_dim, dtype)
        size = (capacity if capacity is not None else initial) + 1
        self.arrays = {name: torch.zeros(size, *shape, dtype=dt, device=self.device) for name, (shape, dt) in self._fields.items()}
        self.refs = torch.zeros(size, dtype=torch.int32, device="cpu")
        self._free = torch.arange(size - 1, 0, -1, dtype=torch.long, device="cpu")  # a stack, top at the end: slots 1, 2, ... first
        self._top = size - 1
        self.peak_used = 0

    # ----- sizes ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable slots (slot 0 aside)."""
        return self.refs.shape[0] - 1

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    @property
    def bytes_per_slot(self) -> int:
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for shape, dt in self._fields.values())

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.bytes_per_slot

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_slot

    # ----- allocation ----------------------------------------------------------------------
    @_plain_tensors
    def allocate(self, n: int) -> torch.Tensor:
        """``n`` free slots (int64 on the pool's device), each with one holder."""
        if n > self._top:
            if self.fixed:
                raise PoolExhausted(n, self._top)
            self._grow(n - self._top)
        slots = self._free[self._top - n : self._top].flip(0)
        self._top -= n
        self.refs[slots] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return slots.to(self.device)

    @_plain_tensors
    def reserve(self, n: int) -> None:
        """Make sure ``n`` slots are free (a growable pool grows once, exactly; a fixed one is left as is)."""
        if n > self._top and not self.fixed:
            self._grow(n - self._top, factor=1.0)

    @_plain_tensors
    def share(self, slots: torch.Tensor) -> None:
        """One more holder for each of ``slots`` (a fork)."""
        index = slots.reshape(-1).long().cpu()
        self.refs.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))

    @_plain_tensors
    def release(self, slots: torch.Tensor) -> None:
        """One holder fewer for each of ``slots``; slots nobody holds go back to the free list."""
        index = slots.reshape(-1).long().cpu()
        if index.numel() == 0:
            return
        self.refs.index_add_(0, index, torch.full_like(index, -1, dtype=torch.int32))
        counts = self.refs[index]
        if bool((counts < 0).any()) or bool((index == PAD_SLOT).any()):
            raise RuntimeError("slot released more often than it was held (a bug in the store's bookkeeping)")
        freed = torch.unique(index[counts == 0])
        self._free[self._top : self._top + freed.numel()] = freed
        self._top += freed.numel()

    def _grow(self, needed: int, factor: float = 1.5) -> None:
        old = self.refs.shape[0]
        size = max(int(old * factor), old + needed)
        for name, array in self.arrays.items():
            grown = torch.zeros(size, *array.shape[1:], dtype=array.dtype, device=array.device)
            grown[:old] = array
            self.arrays[name] = grown
        self.refs = torch.cat([self.refs, torch.zeros(size - old, dtype=torch.int32, device="cpu")])
        free = torch.empty(size, dtype=torch.long, device="cpu")
        added = size - old
        free[:added] = torch.arange(size - 1, old - 1, -1, device="cpu")  # new slots under the ones already free
        free[added : added + self._top] = self._free[: self._top]
        self._free, self._top = free, self._top + added

    # ----- entries -------------------------------------------------------------------------
    @_plain_tensors
    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store entries (keys, values [n, d]) in ``slots`` [n]."""
        rows = self.codec.encode(keys.to(self.dtype), values.to(self.dtype))
        index = slots.reshape(-1).long()
        for name, array in self.arrays.items():
            array.index_copy_(0, index, rows[name])

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [..., d] of ``slots`` [...] (decoded by the codec)."""
        index = slots.reshape(-1).long()
        rows = {name: array.index_select(0, index).view(*slots.shape, *array.shape[1:]) for name, array in self.arrays.items()}
        return self.codec.decode(rows)


class LayerTable:
    """The entries one layer holds for a batch of B rows and H KV heads (see the module docstring)."""

    @_plain_tensors
    def __init__(self, batch: int, heads: int, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.slots = torch.full((batch, heads, 0), PAD_SLOT, dtype=torch.int32, device=self.device)
        self.positions = torch.full((batch, heads, 0), PAD_POSITION, dtype=torch.int32, device=self.device)
        self.log_weights: torch.Tensor | None = None
        self.channels: dict[str, torch.Tensor] = {}
        self._set_lengths(torch.zeros(batch, heads, dtype=torch.long, device="cpu"))  # sizes are decided on the CPU

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        """Entries per head [B, H] (CPU), with the longest and whether every head is that long kept at hand."""
        self.lengths = lengths
        self._longest = int(lengths.max()) if lengths.numel() else 0
        self._uniform = bool((lengths == self._longest).all())

    # ----- sizes ---------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.slots.shape[0]

    @property
    def num_heads(self) -> int:
        return self.slots.shape[1]

    @property
    def capacity(self) -> int:
        return self.slots.shape[2]

    @property
    def longest(self) -> int:
        return self._longest

    @property
    def num_entries(self) -> int:
        return int(self.lengths.sum())

    def entry_bytes(self, pool: SlotPool) -> int:
        """Bytes one entry costs: its slot, its slot index and position, its log-weight and channels."""
        extra = (self.log_weights is not None) + len(self.channels)
        return pool.bytes_per_slot + INDEX_BYTES + POSITION_BYTES + WEIGHT_BYTES * extra

    def nbytes(self, pool: SlotPool) -> int:
        """Bytes held for this layer: every entry (``entry_bytes``) and a length per head."""
        return self.num_entries * self.entry_bytes(pool) + self.lengths.numel() * LENGTH_BYTES

    def held_slots(self) -> torch.Tensor:
        """Every slot this table holds (int64, CPU)."""
        length = self.longest
        valid = torch.arange(length, device="cpu") < self.lengths[..., None]
        return self.slots[:, :, :length].cpu()[valid].long()

    # ----- reading -------------------------------------------------------------------------
    def view(self, pool: SlotPool, summary=None) -> KVView:
        """The entries as a ``KVView`` [B, H, longest]; keys and values are gathered on first use."""
        length = self.longest
        slots = self.slots[:, :, :length]
        return KVView(
            self.positions[:, :, :length].long(),
            self.lengths.clone(),
            uniform=self._uniform,
            load=lambda index: pool.gather(slots if index is None else slots.gather(-1, index)),
            log_weights=None if self.log_weights is None else self.log_weights[:, :, :length],
            channels={name: c[:, :, :length] for name, c in self.channels.items()},
            summary=summary,
        )

    # ----- writing -------------------------------------------------------------------------
    @_plain_tensors
    def append(self, pool: SlotPool, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               token_valid: torch.Tensor | None = None) -> None:
        """Add new entries [B, H, q, d] at positions [B, q]; tokens where ``token_valid`` [B, q] is
        False (padding) are not stored. New entries have log-weight 0 and channels 0."""
        b, h, q, _ = keys.shape
        valid = None
        if token_valid is not None and not bool(token_valid.all()):
            valid = token_valid[:, None, :].expand(b, h, q).to(self.device)
        self._write(pool, keys, values, positions[:, None, :].expand(b, h, q), valid)

    def _write(self, pool: SlotPool, keys, values, positions, valid, log_weights=None, channels=None) -> None:
        """Write entries [B, H, q, ...] (where ``valid`` [B, H, q]; None = all) after each head's last entry."""
        b, h, q, d = keys.shape
        targets = {"log_weights": log_weights, **(channels or {})}
        if valid is None:
            count = b * h * q
            slots = pool.allocate(count)
            pool.write(slots, keys.reshape(count, d), values.reshape(count, d))
            self._reserve(self._longest + q)
            if self._uniform:  # every head as long: the new entries go in one block of columns
                columns = slice(self._longest, self._longest + q)
                self.slots[:, :, columns] = slots.view(b, h, q)
                self.positions[:, :, columns] = positions
                for name, array in self._weights().items():
                    source = targets.get(name)
                    array[:, :, columns] = 0.0 if source is None else source.float()
            else:  # ragged heads: each head's new entries go right after its own last one
                index = self.lengths.to(self.device)[..., None] + torch.arange(q, device=self.device)
                self.slots.scatter_(-1, index, slots.view(b, h, q).to(torch.int32))
                self.positions.scatter_(-1, index, positions.to(torch.int32))
                for name, array in self._weights().items():
                    source = targets.get(name)
                    array.scatter_(-1, index, torch.zeros(b, h, q, device=self.device) if source is None else source.float())
            self.lengths += q
            self._longest += q
            return
        count = int(valid.sum())  # some entries are padding: left-align the real ones per head
        slots = pool.allocate(count)
        pool.write(slots, keys[valid], values[valid])
        added = valid.sum(-1).cpu()
        aligned = torch.arange(q, device=valid.device) < added.to(valid.device)[..., None]
        new = {"slots": _aligned(slots, aligned), "positions": _aligned(positions[valid], aligned, PAD_POSITION)}
        if log_weights is not None:
            targets["log_weights"] = _aligned(log_weights[valid], aligned)
        targets.update({name: _aligned(c[valid], aligned) for name, c in (channels or {}).items()})
        self._reserve(self._longest + q)
        index = (self.lengths.to(self.device)[..., None] + torch.arange(q, device=self.device)).clamp(max=self.capacity - 1)
        mask = torch.arange(q, device=self.device) < added.to(self.device)[..., None]
        _scatter_masked(self.slots, index, new["slots"].to(torch.int32), mask)
        _scatter_masked(self.positions, index, new["positions"].to(torch.int32), mask)
        for name, array in self._weights().items():
            source = targets.get(name)
            source = torch.zeros(b, h, q, device=self.device) if source is None else source.float()
            _scatter_masked(array, index, source, mask)
        self._set_lengths(self.lengths + added)

    def _weights(self) -> dict[str, torch.Tensor]:
        """The float per-entry arrays: log-weights (if any) and channels."""
        arrays = dict(self.channels)
        if self.log_weights is not None:
            arrays["log_weights"] = self.log_weights
        return arrays

    def _reserve(self, needed: int) -> None:
        """Make room for ``needed`` entries per head (doubling, so appends are amortized O(new))."""
        if needed <= self.capacity:
            return
        self._resize(max(needed, 2 * self.capacity, 16))

    def _resize(self, capacity: int) -> None:
        keep = min(capacity, self.capacity)

        def resized(array, fill):
            out = torch.full((*array.shape[:2], capacity), fill, dtype=array.dtype, device=array.device)
            out[:, :, :keep] = array[:, :, :keep]
            return out

        self.slots = resized(self.slots, PAD_SLOT)
        self.positions = resized(self.positions, PAD_POSITION)
        if self.log_weights is not None:
            self.log_weights = resized(self.log_weights, 0.0)
        self.channels = {name: resized(c, 0.0) for name, c in self.channels.items()}

    @_plain_tensors
    def apply(self, pool: SlotPool, edit: Edit) -> None:
        """Carry out a method's edit (see ``Edit`` for the order)."""
        if edit.replace is not None:
            self.release(pool)
            self._replace(pool, edit.replace)
        length = self.longest
        if edit.rewrite is not None:
            self._rewrite(pool, edit.rewrite.mask, edit.rewrite.keys, edit.rewrite.values, length)
        if edit.log_weights is not UNCHANGED:
            if edit.log_weights is None:
                self.log_weights = None
            else:
                self.log_weights = self._set(self.log_weights, edit.log_weights, length)
        for name, values in edit.channels.items():
            self.channels[name] = self._set(self.channels.get(name), values, length)
        if edit.keep is not None:
            self.retain(pool, edit.keep)

    def _set(self, array: torch.Tensor | None, values: torch.Tensor, length: int) -> torch.Tensor:
        if array is None:
            array = torch.zeros(self.slots.shape, dtype=torch.float32, device=self.device)
        array[:, :, :length] = values[:, :, :length].float().to(self.device)
        return array

    def _replace(self, pool: SlotPool, entries: Entries) -> None:
        b, h, _, _ = entries.keys.shape
        self.__init__(b, h, self.device)  # an empty table of the same shape
        if entries.log_weights is not None:
            self.log_weights = torch.zeros(b, h, 0, device=self.device)
        self.channels = {name: torch.zeros(b, h, 0, device=self.device) for name in entries.channels}
        self._write(pool, entries.keys, entries.values, entries.positions, entries.valid.to(self.device),
                    entries.log_weights, entries.channels)

    def _rewrite(self, pool: SlotPool, mask, keys, values, length) -> None:
        """New slots for the entries marked in ``mask`` [B, H, L] (keys, values [N, d] in mask order);
        the old slots are let go."""
        mask = mask.to(self.device)
        table = self.slots[:, :, :length]
        old = table[mask]
        if old.numel() != keys.shape[0]:
            raise ValueError(f"a rewrite marks {old.numel()} entries but carries {keys.shape[0]}")
        if old.numel() == 0:
            return
        if bool((old == PAD_SLOT).any()):
            raise ValueError("a rewrite marks padding: only real entries can be rewritten")
        new = pool.allocate(old.numel())
        pool.write(new, keys, values)
        table[mask] = new.to(torch.int32)
        pool.release(old)

    @_plain_tensors
    def retain(self, pool: SlotPool, keep: torch.Tensor) -> None:
        """Keep the entries marked in ``keep`` [B, H, L] (L = the longest head); free the others' slots."""
        length = keep.shape[-1]
        valid = torch.arange(length, device=self.device) < self.lengths.to(self.device)[..., None]
        keep = keep.to(self.device) & valid
        pool.release(self.slots[:, :, :length][valid & ~keep])
        counts = keep.sum(-1)
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept entries first, in order
        tail = torch.arange(length, device=self.device) >= counts[..., None]
        self.slots[:, :, :length] = self.slots[:, :, :length].gather(-1, order).masked_fill(tail, PAD_SLOT)
        self.positions[:, :, :length] = self.positions[:, :, :length].gather(-1, order).masked_fill(tail, PAD_POSITION)
        for array in self._weights().values():
            array[:, :, :length] = array[:, :, :length].gather(-1, order).masked_fill(tail, 0.0)
        self._set_lengths(counts.cpu())
        longest = self.longest
        if self.capacity > 64 and 4 * longest < self.capacity:  # give back table memory after a large eviction
            self._resize(max(2 * longest, 16))

    # ----- sharing -------------------------------------------------------------------------
    @_plain_tensors
    def share(self, pool: SlotPool) -> LayerTable:
        """An independent table holding the same entries (the slots get one more holder each)."""
        twin = LayerTable.__new__(LayerTable)
        twin.device = self.device
        twin.slots, twin.positions = self.slots.clone(), self.positions.clone()
        twin._set_lengths(self.lengths.clone())
        twin.log_weights = None if self.log_weights is None else self.log_weights.clone()
        twin.channels = {name: c.clone() for name, c in self.channels.items()}
        pool.share(self.held_slots())
        return twin

    @_plain_tensors
    def release(self, pool: SlotPool) -> None:
        """Let go of every entry (the table is empty afterwards)."""
        pool.release(self.held_slots())
        self.__init__(self.batch_size, self.num_heads, self.device)


def _aligned(flat: torch.Tensor, aligned: torch.Tensor, fill=0) -> torch.Tensor:
    """Entries [N, ...] laid out left-aligned per head where ``aligned`` [B, H, q] is True."""
    out = torch.full((*aligned.shape, *flat.shape[1:]), fill, dtype=flat.dtype, device=flat.device)
    out[aligned] = flat
    return out


def _scatter_masked(array: torch.Tensor, index: torch.Tensor, source: torch.Tensor, mask: torch.Tensor) -> None:
    """array[b, h, index[b, h, j]] = source[b, h, j] where ``mask`` [B, H, q]."""
    b_idx, h_idx, j_idx = mask.nonzero(as_tuple=True)
    array[b_idx, h_idx, index[b_idx, h_idx, j_idx]] = source[b_idx, h_idx, j_idx]


__all__ = ["LayerTable", "PAD_SLOT", "PoolExhausted", "SlotPool"]
