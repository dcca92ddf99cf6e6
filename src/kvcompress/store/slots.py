"""The slot pool: where every KV entry lives, and the slot tables that say which entries a head holds.

* ``SlotPool``: one set of per-slot arrays for every layer and sequence. A slot holds one
  entry — the key and the value of one KV head at one token — so layers and heads may hold
  any number of entries within one memory budget. Slot 0 is never handed out (padded
  tables point at it). A free list hands out and takes back slots; reference counts let
  forks of a sequence share entries (a slot is free again when its last holder lets it go).
  A fixed pool (``capacity=``, the engine) is a byte budget of ``capacity`` plain slots: its
  plain slots and its coded blocks together never hold more, and it raises ``PoolExhausted``
  when full; its arrays grow as entries arrive, up to the budget. A growable one (the
  single-request cache) grows by 1.5×. Coded entries (KIVI) live in tiers beside the plain
  slots: tier t ≥ 1 is a pool of blocks of one codec (KIVI, DeltaKV), and an entry id
  ``t << TIER_SHIFT | block · block_size + offset`` names an entry inside a block; a block
  is held once per entry naming it, so it is freed when its last entry goes.
* ``SlotTable``: rows × KV heads of slot tables — per (row, KV head) the slots of the
  entries it holds, their positions, optional log-weights and per-entry method channels,
  left-aligned in arrays [R, H, capacity] that grow by doubling. A session keeps one table
  for all its layers (row l·B + b = layer l, batch row b), so one layer is a range of rows
  and a step's edits for every layer can be applied at once. Appending writes only the
  new entries (amortized O(new)); evicting compacts the rows and frees the slots; a rewrite
  (a merge) writes new slots and frees the old ones, so a fork never sees another fork's
  changes.

Nothing here knows a method or transformers: edits arrive as ``store.view.Edit``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import numpy as np
import torch

from .. import hugepages
from ..kernels import NOTHING, cpu_kernels
from .codecs import Codec, PlainCodec, field_bytes
from .view import PAD_POSITION, UNCHANGED, Edit, Entries, KVView, Pages

PAD_SLOT = 0
TIER_SHIFT = 27  # entry ids are int32: tiers 1..15 of coded blocks above 2^27 plain slots
MAX_TIERS = 15
ENTRY_MASK = 2**TIER_SHIFT - 1  # an entry id's place inside its tier
INDEX_BYTES = 4  # a slot index (int32) per entry
POSITION_BYTES = 4  # an original position (int32) per entry
WEIGHT_BYTES = 4  # a log-weight or a channel value (float32) per entry
LENGTH_BYTES = 8  # an entry count (int64) per head


@contextlib.contextmanager
def plain_tensors():
    """Outside inference mode and autograd for the block, so that what the store creates there are ordinary tensors:
    entries written under ``torch.inference_mode`` (a generate call) stay writable afterwards (a fork, a release from a
    finalizer). Store operations enter it themselves (``_plain_tensors``); a caller making many of them at once (the
    engine's step, a ``begin_step`` per request) enters it once around them, since each switch of mode costs about as
    much as a small operation."""
    if not torch.is_inference_mode_enabled() and not torch.is_grad_enabled():
        yield  # already plain (a store operation calling another)
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _plain_tensors(fn):
    """Run a store operation as within ``plain_tensors``: the same check and switch written out, since every store
    operation passes here and the generator-based context costs ~0.8 µs more a call (2.3 → 3.1 µs)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled() and not torch.is_grad_enabled():
            return fn(*args, **kwargs)  # already plain (a store operation calling another)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


class PoolExhausted(RuntimeError):
    """A fixed pool has less room than asked for (in slots: a plain slot's bytes each)."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"the KV slot pool has {free} free slots, {needed} are needed")
        self.needed, self.free = needed, free


def distinct(index: torch.Tensor) -> torch.Tensor:
    """The distinct values of a CPU int64 tensor, ascending: ``torch.unique``'s result, by numpy's sort (on a Zen 5, 24K
    shuffled slots: 65-80 against 1000 µs; inside the engine a finished request's release took 0.90 ms, against 1.20)."""
    ordered = np.sort(index.numpy())
    keep = np.empty(ordered.shape[0], dtype=bool)
    keep[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return torch.from_numpy(ordered[keep])


class SlotPool:
    """Per-slot arrays for every entry of every layer and sequence (see the module docstring).

    Args:
        head_dim: d of one key (and value).
        dtype, device: of the stored entries.
        capacity: the budget of a fixed pool, in plain slots: its plain slots and coded blocks together hold
            at most ``capacity`` plain slots' bytes (its arrays start at ``initial`` slots and grow up to it);
            None = growable without bound.
        codec: how an entry is stored: plain keys and values (the default) for a pool; a tier (``tier``) is
            a pool of one codec's blocks, within its pool's budget.
    """

    @_plain_tensors
    def __init__(self, head_dim: int, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 capacity: int | None = None, codec: Codec | None = None, initial: int = 4096):
        if capacity is not None and not 1 <= capacity < 2**TIER_SHIFT:
            raise ValueError(f"a fixed pool needs between 1 and {ENTRY_MASK} slots, got capacity={capacity}")
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.codec = codec or PlainCodec()
        self.limit = capacity  # a fixed pool's budget, in plain slots
        self.budget: SlotPool = self  # the pool whose budget this one draws on (its own; a tier: its pool's)
        self._fields = self.codec.fields(head_dim, dtype)
        self.bytes_per_slot = field_bytes(self._fields)  # of one slot (of a tier: one block)
        self._initial = min(initial, capacity if capacity is not None else initial)
        self._reserved = None  # a fixed CPU pool's arrays at its whole budget (``_reserves``)
        self._empty_arrays(self._initial)
        self.peak_bytes = 0  # the most bytes held at once, tiers included
        self.peak_allocated = 0  # the most bytes the arrays took at once, tiers included
        self.tiers: list[SlotPool] = []  # tier t ≥ 1: a pool of coded blocks (``tier``)

    def _empty_arrays(self, slots: int) -> None:
        size = slots + 1
        if self._reserves():  # the arrays: the first ``size`` slots of the budget's mapping
            try:
                self._reserved = {name: hugepages.zeros(self.limit + 1, *shape, dtype=dt) for name, (shape, dt) in self._fields.items()}
                self.arrays = {name: array[:size] for name, array in self._reserved.items()}
            except (OSError, RuntimeError):  # the system would not map the whole budget at once: the arrays grow as before
                self._reserved = None
        if self._reserved is None:
            # on the CPU on 2 MiB pages: a decoding step reads held entries at scattered slots, one TLB miss a 4 KiB page otherwise
            self.arrays = {name: hugepages.zeros(size, *shape, dtype=dt, device=self.device) for name, (shape, dt) in self._fields.items()}
        self.refs = torch.zeros(size, dtype=torch.int32, device="cpu")
        self._free = torch.arange(size - 1, 0, -1, dtype=torch.long, device="cpu")  # a stack, top at the end: slots 1, 2, ... first
        self._top = size - 1

    @_plain_tensors
    def trim(self) -> None:
        """When nothing is held, give the arrays' memory back: the tiers, and a pool not in one mapping, return to their
        first size (the engine, idle: they grow again with the next load). A pool in one mapping (``_reserves``) keeps
        the slots its loads touched, as vLLM's cache keeps its memory: given back, the next load faulted every page in
        again (~1 s of a 14 s load of 16,000 tokens into a 1 GiB pool on a 2-core Zen 5)."""
        if self.used_bytes == 0:
            for store in (self, *self.tiers):
                if store._arena != store._initial and store._reserved is None:  # at its first size: nothing to give back
                    store._empty_arrays(store._initial)

    # ----- sizes ---------------------------------------------------------------------------
    @property
    def fixed(self) -> bool:
        """A pool with a budget (the engine's), not one that grows without bound."""
        return self.limit is not None

    @property
    def capacity(self) -> int:
        """Usable slots: a fixed pool's budget; the slots a growable pool's arrays hold now (slot 0 aside)."""
        return self.limit if self.limit is not None else self._arena

    def _reserves(self) -> bool:
        """Whether the arrays are the first slots of one mapping the size of the budget, made at once: a fixed pool on a
        CPU that advises huge pages, whose untouched pages take no memory (``hugepages.zeros``). Growing then moves
        nothing (copying the arrays at each growth took ~1.1 s of a 16,000-token load into an idle 1 GiB pool); the
        pages its loads touched stay (``trim``)."""
        return self.limit is not None and self.device.type == "cpu" and hugepages.advises()

    @property
    def _arena(self) -> int:
        """Slots the arrays hold now (slot 0 aside)."""
        return self.refs.shape[0] - 1

    @property
    def num_free(self) -> int:
        """Plain slots that can still be handed out (a fixed pool: what its budget has left, tiers counted)."""
        if self.limit is None:
            return self._top
        return self._room_bytes // self.bytes_per_slot

    @property
    def _room_bytes(self) -> int:
        """What a fixed pool's budget has left, in bytes (its tiers' holdings counted)."""
        return self.capacity_bytes - self.used_bytes

    @property
    def num_used(self) -> int:
        """Slots (or blocks) held."""
        return self._arena - self._top

    @property
    def capacity_bytes(self) -> int:
        """A fixed pool's budget; a growable pool's arrays."""
        return self.limit * self.bytes_per_slot if self.limit is not None else self.allocated_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the arrays as allocated now, tiers included (what the process holds for the pool)."""
        return self._arena * self.bytes_per_slot + sum(tier.allocated_bytes for tier in self.tiers)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.bytes_per_slot + sum(tier.used_bytes for tier in self.tiers)

    def held_bytes(self, ids: torch.Tensor) -> int:
        """Bytes of storage behind entry ids [...]: a plain slot each, and every coded block they touch
        (whole: a block partly evicted still holds all its memory)."""
        return sum((index.numel() if store is self else distinct(index).numel()) * store.bytes_per_slot
                   for store, index in self._by_tier(ids))

    # ----- coded tiers ---------------------------------------------------------------------
    def tier(self, codec: Codec) -> int:
        """The tier storing entries with ``codec`` (made on first use; codecs with the same ``key`` share one)."""
        for t, store in enumerate(self.tiers, start=1):
            if store.codec.key == codec.key:
                return t
        if len(self.tiers) == MAX_TIERS:
            raise ValueError(f"a pool holds at most {MAX_TIERS} codecs at once")
        store = SlotPool(self.head_dim, dtype=self.dtype, device=self.device, codec=codec, initial=64)
        store.budget = self.budget
        self.tiers.append(store)
        tier = len(self.tiers)
        if hasattr(codec, "attach"):  # a codec with tiers of its own beside it (DeltaKV's references)
            codec.attach(self)
        return tier

    @_plain_tensors
    def encode(self, tier: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Store n blocks of entries (keys, values [n, block_size, d]) in ``tier``: their entry ids [n, block_size]."""
        store = self.tiers[tier - 1]
        size = store.codec.block_size
        blocks = store.allocate(keys.shape[0], holders=size)
        store.write(blocks, keys, values)
        return (tier << TIER_SHIFT) | (blocks[:, None] * size + torch.arange(size, device=blocks.device))

    # ----- allocation ----------------------------------------------------------------------
    @_plain_tensors
    def allocate(self, n: int, holders: int = 1) -> torch.Tensor:
        """``n`` free slots (int64 on the pool's device), each with ``holders`` holders."""
        budget = self.budget
        if budget.limit is not None:
            room = budget._room_bytes
            if n * self.bytes_per_slot > room:
                raise PoolExhausted(-(-n * self.bytes_per_slot // budget.bytes_per_slot), room // budget.bytes_per_slot)
        if n > self._top:
            self._grow(n - self._top)
        slots = self._free[self._top - n : self._top].flip(0)
        self._top -= n
        self.refs[slots] = holders
        budget.peak_bytes = max(budget.peak_bytes, budget.used_bytes)
        return slots.to(self.device)

    @_plain_tensors
    def reserve(self, n: int) -> None:
        """Make sure ``n`` slots are free (a growable pool grows once, exactly; a fixed one grows as it fills)."""
        if n > self._top and not self.fixed:
            self._grow(n - self._top, factor=1.0)

    @_plain_tensors
    def relocate(self, slots: torch.Tensor) -> torch.Tensor:
        """Move the entries of plain ``slots`` [n] (each held once) into free slots taken smallest first, in ascending
        order, and free the old ones; returns where they went [n] (int64, on the pool's device), or ``slots`` unchanged
        where the free slots cannot take them without growing the arrays or passing the budget. An eviction leaves a
        head's entries spread over the pool; moved in order, they lie in ascending runs that the CPU's prefetch follows
        (on a Zen 5 the engine's float32 SnapKV read, 131 → 104-107 µs a layer)."""
        n = slots.numel()
        if n == 0 or n > min(self._top, self.num_free):  # free in the arrays now, and within the budget
            return slots
        self._sort_free()
        budget = self.budget
        peak = budget.peak_bytes
        moved = self.allocate(n)
        for array in self.arrays.values():
            array[moved] = array[slots.to(array.device)]
        self.release(slots)
        budget.peak_bytes = peak  # the move only borrows slots that were free: it needs no byte more than is held
        return moved

    def _sort_free(self) -> None:
        """The free stack as every free slot (nobody holds it) in descending order, the smallest on top: read off the
        holders' counts in one pass over the arrays' slots, not sorted (a sort of the stack took 55-270 ms at 4M slots)."""
        self._free[: self._top] = (self.refs[1:] == 0).nonzero().squeeze(1).add_(1).flip(0)

    @_plain_tensors
    def share(self, slots: torch.Tensor) -> None:
        """One more holder for each of ``slots`` (entry ids: a fork)."""
        for store, index in self._by_tier(slots):
            store.refs.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))

    @_plain_tensors
    def release(self, slots: torch.Tensor) -> None:
        """One holder fewer for each of ``slots`` (entry ids); slots and blocks nobody holds are free again, and
        let go of what freed coded blocks held (DeltaKV's references)."""
        for store, index in list(self._by_tier(slots)):
            freed = store._let_go(index)
            if freed.numel() and hasattr(store.codec, "dependencies"):
                self.release(store.codec.dependencies(store.arrays, freed))

    def _by_tier(self, ids: torch.Tensor):
        """(pool, its slots or blocks [n] int64 on the CPU) for the entry ids [...]: one pair per tier they use."""
        index = ids.reshape(-1).long().cpu()
        if not self.tiers:
            yield self, index
            return
        tiers = index >> TIER_SHIFT
        yield self, index[tiers == 0]
        for t, store in enumerate(self.tiers, start=1):
            local = index[tiers == t]
            if local.numel():
                yield store, (local & ENTRY_MASK) // store.codec.block_size

    def _let_go(self, index: torch.Tensor) -> torch.Tensor:
        """One holder fewer for each slot of ``index``: the slots freed."""
        if index.numel() == 0:
            return index
        self.refs.index_add_(0, index, torch.full_like(index, -1, dtype=torch.int32))
        counts = self.refs[index]
        if bool(((counts < 0) | (index == PAD_SLOT)).any()):
            raise RuntimeError("a slot released more often than it was held, or padding released (a bug in the store's bookkeeping)")
        freed = distinct(index[counts == 0])
        self._free[self._top : self._top + freed.numel()] = freed
        self._top += freed.numel()
        return freed

    def _grow(self, needed: int, factor: float = 1.5) -> None:
        old = self.refs.shape[0]
        size = max(int(old * factor), old + needed)
        if self.limit is not None:  # a fixed pool's arrays stop at its budget (the budget was checked)
            size = min(size, self.limit + 1)
        if size * self.codec.block_size > 2**TIER_SHIFT:  # entry ids must stay below the tier bits
            raise PoolExhausted(needed, self._top)
        budget = self.budget
        budget.peak_allocated = max(budget.peak_allocated, budget.allocated_bytes + (size - old) * self.bytes_per_slot)
        if self._reserved is not None:  # the next slots of the mapping: nothing moves
            self.arrays = {name: array[:size] for name, array in self._reserved.items()}
        else:
            for name, array in self.arrays.items():
                grown = hugepages.zeros(size, *array.shape[1:], dtype=array.dtype, device=array.device)
                grown[:old] = array
                self.arrays[name] = grown
        self.refs = torch.cat([self.refs, torch.zeros(size - old, dtype=torch.int32, device="cpu")])
        free = torch.empty(size, dtype=torch.long, device="cpu")
        added = size - old
        free[:added] = torch.arange(size - 1, old - 1, -1, device="cpu")  # new slots under the ones already free
        free[added : added + self._top] = self._free[: self._top]
        self._free, self._top = free, self._top + added

    # ----- entries -------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store entries (keys, values [n, d]) in ``slots`` [n] (in place: it creates nothing the store keeps, so it needs no
        ``_plain_tensors``, whose mode switch costs a decoding layer as much as the copies)."""
        rows = self.codec.encode(keys.to(self.dtype), values.to(self.dtype))
        index = slots.reshape(-1).long()
        for name, array in self.arrays.items():
            array.index_copy_(0, index, rows[name])

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [..., d] of entry ids ``slots`` [...] (coded entries decoded: only these)."""
        index = slots.reshape(-1).long()
        shape = (*slots.shape, self.head_dim)
        tiers = (index >> TIER_SHIFT) if self.tiers else None
        if tiers is None or not bool(tiers.any()):
            keys, values = self.codec.decode(self.arrays, index)
            return keys.view(shape), values.view(shape)
        plain = torch.where(tiers == 0, index, PAD_SLOT)  # coded entries read padding here, then are overwritten
        keys, values = self.codec.decode(self.arrays, plain)
        for t, store in enumerate(self.tiers, start=1):
            where = (tiers == t).nonzero().squeeze(1)
            if where.numel():
                k, v = store.codec.decode(store.arrays, index.index_select(0, where) & ENTRY_MASK)
                keys.index_copy_(0, where, k.to(self.dtype))
                values.index_copy_(0, where, v.to(self.dtype))
        return keys.view(shape), values.view(shape)


Rows = slice | None  # a range of a table's rows; None = all


class SlotTable:
    """Slot tables of R rows × H KV heads (see the module docstring).

    Per (row, head), left-aligned: ``ids`` int32 [R, H, capacity, 2] (slot, original position) and,
    when a method sets any, ``weights`` float32 [R, H, capacity, C] (the log-weights and the method's
    channels, one column each, named in ``columns``). Padding holds (slot 0, a position after every
    real one) and zero weights. With ``page_size`` P > 0 the table also keeps, for every P
    consecutive entries of a head, each key channel's min and max (``page_bounds``, in the keys'
    dtype, [R, H, pages, 2, d]; Quest's index): right for every full page (a head's open page is
    computed only when it fills, or when a larger append or an edit refreshes it).
    Every operation takes ``rows`` (a slice; None = all rows) and works in the layout of
    ``view(pool, rows)``.
    """

    LOG_WEIGHTS = "log_weights"

    @_plain_tensors
    def __init__(self, rows: int, heads: int, device: str | torch.device = "cpu", page_size: int = 0):
        self.device = torch.device(device)
        self.ids = torch.empty(rows, heads, 0, 2, dtype=torch.int32, device=self.device)
        self.weights = None
        self.columns: list[str] = []
        self.lengths = torch.zeros(rows, heads, dtype=torch.long, device="cpu")  # sizes are decided on the CPU
        self.page_size = page_size
        self.page_bounds: torch.Tensor | None = None  # [R, H, pages, 2, d]: per page of entries, each channel's min and max key
        self._pages_due: set[int] | None = None  # rows whose page bounds the last ``append_slots`` may change (None: any)

    # ----- sizes and named parts -------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]

    @property
    def num_heads(self) -> int:
        return self.ids.shape[1]

    @property
    def capacity(self) -> int:
        return self.ids.shape[2]

    def span(self, rows: Rows = None) -> tuple[int, bool]:
        """(the longest head, whether every head is that long) among ``rows``."""
        sizes = self.lengths[_all(rows)].view(-1).tolist()
        longest = max(sizes, default=0)
        return longest, min(sizes, default=0) == longest

    def num_entries(self, rows: Rows = None) -> int:
        return int(self.lengths[_all(rows)].sum())

    @property
    def ids(self) -> torch.Tensor:
        return self._ids

    @ids.setter
    def ids(self, ids: torch.Tensor) -> None:
        self._ids, self._slots, self._slot_rows = ids, None, None

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [R, H] on the CPU: the entries each head holds (changed in place; a new array only on assignment)."""
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: torch.Tensor) -> None:
        self._lengths, self._length_rows = lengths, None

    @property
    def weights(self) -> torch.Tensor | None:
        return self._weights

    @weights.setter
    def weights(self, weights: torch.Tensor | None) -> None:  # the columns change only with a new array
        self._weights, self._log_weights, self._log_weight_rows = weights, None, None

    @property
    def slots(self) -> torch.Tensor:
        """int32 [R, H, capacity]: each entry's slot (a view, made once per ``ids`` array: a decoding step takes a
        row of it per layer and request)."""
        if self._slots is None:
            self._slots = self._ids[..., 0]
        return self._slots

    def log_weight_column(self) -> torch.Tensor | None:
        """float32 [R, H, capacity]: each entry's log-weight (a view, made once per ``weights`` array), or None."""
        if self._log_weights is None and self.LOG_WEIGHTS in self.columns:
            self._log_weights = self._weights[..., self.columns.index(self.LOG_WEIGHTS)]
        return self._log_weights

    def row_views(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``row``'s lengths [H], slots [H, capacity] and log-weights [H, capacity] (or None) as views of the
        arrays, made once per array (a decoding step takes them per layer and request: one unbind, not an index each)."""
        if self._length_rows is None:
            self._length_rows = self._lengths.unbind(0)
        if self._slot_rows is None:
            self._slot_rows = self.slots.unbind(0)
        if self._log_weight_rows is None:
            column = self.log_weight_column()
            self._log_weight_rows = [None] * self.num_rows if column is None else column.unbind(0)
        return self._length_rows[row], self._slot_rows[row], self._log_weight_rows[row]

    @property
    def positions(self) -> torch.Tensor:
        """int32 [R, H, capacity]: each entry's original position (a view)."""
        return self.ids[..., 1]

    def entry_metadata_bytes(self) -> int:
        """Bytes one entry costs in the table: its slot index and position, its log-weight and channels."""
        return INDEX_BYTES + POSITION_BYTES + WEIGHT_BYTES * len(self.columns)

    def nbytes(self, pool: SlotPool, rows: Rows = None) -> int:
        """Bytes held for ``rows``: the storage behind every entry (``SlotPool.held_bytes``), its metadata,
        a length per head and the page bounds."""
        lengths = self.lengths[_all(rows)]
        entries = int(lengths.sum())
        storage = entries * pool.bytes_per_slot if not pool.tiers else pool.held_bytes(self.held_slots(rows))
        held = storage + entries * self.entry_metadata_bytes() + lengths.numel() * LENGTH_BYTES
        if self.page_bounds is not None:
            pages = int(((lengths + self.page_size - 1) // self.page_size).sum())
            held += pages * 2 * self.page_bounds.shape[-1] * self.page_bounds.element_size()
        return held

    def held_slots(self, rows: Rows = None) -> torch.Tensor:
        """Every slot ``rows`` hold (int64, CPU), head by head: numpy's mask over the tables' strided view (a finished
        request's ~22K entries in the engine, on a Zen 5: 0.15-0.19 ms, against 0.30 by torch's mask)."""
        rows = _all(rows)
        lengths = self.lengths[rows].cpu().numpy()
        longest = int(lengths.max(initial=0))
        valid = np.arange(longest) < lengths[..., None]
        return torch.from_numpy(self.ids[rows, :, :longest, 0].cpu().numpy()[valid].astype(np.int64))

    # ----- reading -------------------------------------------------------------------------
    def view(self, pool: SlotPool, rows: Rows = None, summary=None) -> KVView:
        """``rows`` as a ``KVView`` [r, H, longest]; keys and values are gathered on first use."""
        rows = _all(rows)
        longest, uniform = self.span(rows)
        ids = self.ids[rows, :, :longest]
        slots = ids[..., 0]
        weights = None if self.weights is None else self.weights[rows, :, :longest]
        columns = dict(zip(self.columns, range(len(self.columns))))
        log_weights = columns.pop(self.LOG_WEIGHTS, None)
        log_weights = None if log_weights is None else weights[..., log_weights]
        lengths = self.lengths[rows].clone()
        return KVView(
            lambda: ids[..., 1].long(),  # a read in place needs none
            lengths,
            shape=ids.shape[:3],
            uniform=uniform,
            load=lambda index: pool.gather(slots if index is None else slots.gather(-1, index)),
            log_weights=log_weights,
            channels={name: weights[..., i] for name, i in columns.items()},
            summary=summary,
            page_bounds=None if self.page_bounds is None else self.page_bounds[rows, :, : -(-longest // self.page_size)],
            page_size=self.page_size,
            pages=SlotTable._pages(pool, [self.row_views(row) for row in range(*rows.indices(self.num_rows))], lengths),
        )

    @staticmethod
    def _pages(pool: SlotPool, views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
               lengths: torch.Tensor) -> Callable[[], Pages | None]:
        """The in-place form of rows whose ``row_views`` are ``views``, made when a read asks for it: per row its slot
        column and log-weights; None unless every entry is plain or of tiers one codec's in-place read covers (``in_place``:
        a KIVI tier, DeltaKV's codes and references)."""
        slots, weights = [v[1] for v in views], [v[2] for v in views]

        def pages() -> Pages | None:
            blocks = SlotTable._in_place_blocks(pool, slots, lambda: lengths.amax(-1).tolist())
            return None if blocks is False else Pages(_pool_arrays(pool, blocks), slots, lengths, weights)

        return pages

    @staticmethod
    def _in_place_blocks(pool: SlotPool, slots: list[torch.Tensor], spans: Callable[[], list[int]]):
        """What an in-place read of tables ``slots`` (per row, [..., H, L]: the entries of each row's heads lie in its first
        ``spans()[row]`` columns) takes for their coded entries: a function making the blocks of the one reader that covers
        every tier they name, None where every entry is plain, False where no reader covers them all (or the pool's plain
        entries are not stored as they are read)."""
        if not isinstance(pool.codec, PlainCodec):
            return False
        if not pool.tiers:
            return None
        readers = [reader for tier, store in enumerate(pool.tiers, 1)
                   if (reader := getattr(store.codec, "in_place", lambda *_: None)(pool, tier)) is not None]
        if len(readers) == 1 and readers[0][0] == set(range(1, len(pool.tiers) + 1)):  # one reader for every tier: any row may name any
            return readers[0][1]
        named = set().union(*(torch.unique(s[..., :span] >> TIER_SHIFT).tolist() for s, span in zip(slots, spans()))) - {0}
        fitting = [make for covered, make in readers if named <= covered]
        if named and not fitting:
            return False  # coded entries of tiers no in-place read covers together
        return fitting[0] if named else None

    @staticmethod
    def step_pages(pool: SlotPool, tables: list[SlotTable], lengths: torch.Tensor | None = None) -> Pages | None:
        """Every row of each table where its entries live, for the reads of a decoding step's layers (row l of each table:
        layer l): per table its slots [L, H, capacity] and log-weights (or None), the lengths [L, len(tables), H]
        (``step_lengths``, or ``lengths`` where the caller read them already); None where they cannot all be read in place."""
        slots = [table.slots for table in tables]
        lengths = SlotTable.step_lengths(tables) if lengths is None else lengths
        blocks = SlotTable._in_place_blocks(pool, slots, lambda: lengths.amax((0, 2)).tolist())
        if blocks is False:
            return None
        return Pages(_pool_arrays(pool, blocks), slots, lengths, [table.log_weight_column() for table in tables])

    @staticmethod
    def _joint_rows(tables: list[SlotTable], row: int, lengths: torch.Tensor | None) -> tuple[list, torch.Tensor]:
        """Row ``row``'s ``row_views`` of each table, and their heads' lengths [len(tables), H] (``lengths`` where the
        caller read them already)."""
        views = [table.row_views(row) for table in tables]
        return views, torch.stack([v[0] for v in views]) if lengths is None else lengths

    @staticmethod
    def step_lengths(tables: list[SlotTable]) -> torch.Tensor:
        """Every row's lengths of tables with the same rows, side by side: [rows, len(tables), H] (row r: what
        ``joint_view`` takes for one layer of a decoding step whose tables do not change, read at once)."""
        return torch.stack([table.lengths for table in tables], 1)

    @staticmethod
    def joint_view(pool: SlotPool, tables: list[SlotTable], row: int, summaries: list, lengths: torch.Tensor | None = None) -> KVView:
        """One view over row ``row`` of each table (a layer of the engine's running requests), [len(tables), H, L]:
        heads padded to the longest of all; log-weights where a table has them (0 elsewhere); ``summaries[i]``
        applies to table i's row. ``lengths``: the rows' [len(tables), H], where the caller read them already
        (``step_lengths``)."""
        views, lengths = SlotTable._joint_rows(tables, row, lengths)
        sizes = lengths.view(-1).tolist()  # every head's length, read once
        longest = max(sizes, default=0)
        heads = lengths.shape[1]
        joint: list[torch.Tensor] = []

        def ids() -> torch.Tensor:  # the joint (slot, position) table, made only for a read that is not in place (once)
            if not joint:
                joint.append(torch.cat([_padded(table.ids[row : row + 1, :, :span], longest, PAD_IDS)
                                        for table, span in zip(tables, _row_spans(sizes, heads))]))
            return joint[0]

        def log_weights() -> torch.Tensor | None:
            if all(v[2] is None for v in views):
                return None
            return torch.stack([
                torch.zeros(heads, longest, device=table.device) if w is None else _padded(w[None, :, :span], longest, 0.0)[0]
                for table, (_, _, w), span in zip(tables, views, _row_spans(sizes, heads))
            ])

        def load(index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            slots = ids()[..., 0]
            return pool.gather(slots if index is None else slots.gather(-1, index))

        return KVView(
            lambda: ids()[..., 1].long(),
            lengths,
            shape=(len(tables), heads, longest),
            uniform=all(n == longest for n in sizes),
            load=load,
            log_weights=log_weights,
            summary=None if all(s is None for s in summaries) else RowSummaries(summaries, [1] * len(tables)),
            pages=SlotTable._pages(pool, views, lengths),
        )

    # ----- writing -------------------------------------------------------------------------
    @_plain_tensors
    def append(self, pool: SlotPool, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               token_valid: torch.Tensor | None = None, rows: Rows = None) -> None:
        """Add new entries [r, H, q, d] at positions [r, q] to ``rows``; tokens where ``token_valid``
        [r, q] is False (padding) are not stored. New entries have log-weight 0 and channels 0."""
        r, h, q, _ = keys.shape
        valid = None
        if token_valid is not None and not bool(token_valid.all()):
            valid = token_valid[:, None, :].expand(r, h, q).to(self.device)
        self._write(pool, keys, values, positions[:, None, :].expand(r, h, q), valid, None, _all(rows))

    def _write(self, pool: SlotPool, keys, values, positions, valid, weights, rows: slice) -> None:
        """Write entries [r, H, q, ...] (where ``valid`` [r, H, q]; None = all) after each head's last entry
        of ``rows``; ``weights`` [r, H, q, C] in this table's columns (None: zeros)."""
        r, h, q, d = keys.shape
        if valid is None:
            count = r * h * q
            slots = pool.allocate(count).view(r, h, q)
            if keys.transpose(1, 2).is_contiguous() and values.transpose(1, 2).is_contiguous():  # a prompt's rows [q, H, d]:
                # written in their own order, the slots' ids reordered to them (no copy of the entries first)
                pool.write(slots.transpose(1, 2), keys.transpose(1, 2).reshape(count, d), values.transpose(1, 2).reshape(count, d))
            else:
                pool.write(slots, keys.reshape(count, d), values.reshape(count, d))
            ids = torch.stack([slots.to(torch.int32), positions.to(torch.int32)], dim=-1)
            added = None
        else:  # some entries are padding: left-align the real ones per head
            count = int(valid.sum())
            slots = pool.allocate(count)
            pool.write(slots, keys[valid], values[valid])
            added = valid.sum(-1).cpu()
            aligned = torch.arange(q, device=valid.device) < added.to(valid.device)[..., None]
            ids = _aligned(torch.stack([slots.to(torch.int32), positions[valid].to(torch.int32)], dim=-1), aligned, PAD_IDS)
            if weights is not None:
                weights = _aligned(weights[valid], aligned, 0.0)
        self._record(pool, ids, added, weights, rows)

    @_plain_tensors
    def append_slots(self, pool: SlotPool, slots: torch.Tensor, positions: torch.Tensor, rows: Rows = None) -> None:
        """Record one entry per head (``slots`` [r, H, 1] at positions [r, 1]) after each head's last entry of
        ``rows``, before its key and value are written there (the engine's decoding step records every layer's
        entries before the forward writes them, layer by layer); once a row's are written, ``written`` brings
        its page bounds up to date."""
        r, h, q = slots.shape
        rows = _all(rows)
        ids = torch.stack([slots.to(torch.int32), positions[:, None, :].expand(r, h, q).to(torch.int32)], dim=-1)
        counts = self.lengths[rows].tolist() if self.page_size else None
        self._record(pool, ids, None, None, rows, pages=False)
        if counts is not None:  # the rows whose entry fills a page, or outgrows the bounds: once, not a layer at a time
            room = 0 if self.page_bounds is None else self.page_bounds.shape[2] * self.page_size
            first = range(self.num_rows)[rows].start
            self._pages_due = {first + i for i, heads in enumerate(counts)
                               if max(heads) >= room or any((n + 1) % self.page_size == 0 for n in heads)}

    @staticmethod
    @_plain_tensors
    def append_step(pool: SlotPool, tables: list[SlotTable], slots: torch.Tensor, positions: list[int]) -> None:
        """A decoding step's ``append_slots`` for the tables of many requests at once: table t records the slots [L, H]
        ``slots[t]`` (int64 [T, L, H], one row a layer) at position ``positions[t]``. On the CPU one compiled pass records
        them in every table with room and no page bounds to follow (``csrc/append_step.cpp``); each other table takes
        ``append_slots``."""
        kernel = cpu_kernels() if slots.device.type == "cpu" else None
        done = [False] * len(tables)
        if kernel is not None:
            done = kernel.append_step([t.ids for t in tables], [t.lengths for t in tables],
                                      [NOTHING if t.weights is None else t.weights for t in tables], slots.contiguous(), positions,
                                      [not t.page_size and t.lengths.is_contiguous() for t in tables])
        for table, recorded, table_slots, position in zip(tables, done, slots, positions):
            if recorded:
                table._pages_due = None
            else:
                at = torch.full((table_slots.shape[0], 1), position, dtype=torch.int32, device=table_slots.device)
                table.append_slots(pool, table_slots[:, :, None], at)

    @_plain_tensors
    def drop_last(self, pool: SlotPool, rows: Rows = None) -> None:
        """Take back the last entry of each head of ``rows`` (one ``append_slots`` recorded for a decoding step whose
        forward stopped before their layer wrote it) and let go of its slot."""
        rows = _all(rows)
        last = (self.lengths[rows] - 1).to(self.device)[..., None, None].expand(-1, -1, 1, 2)  # [r, H, 1, 2]
        ids = self.ids[rows]
        slots = ids.gather(2, last)[..., 0]
        ids.scatter_(2, last, PAD_IDS.to(self.device).expand_as(last).contiguous())
        self.lengths[rows] -= 1
        pool.release(slots)

    @_plain_tensors
    def written(self, pool: SlotPool, rows: Rows = None) -> None:
        """The last entry of each head of ``rows`` (recorded by ``append_slots``) now holds its key in the pool: the
        page bounds follow (``_pages_after_one``)."""
        if not self.page_size:
            return
        rows = _all(rows)
        if self._pages_due is not None and self._pages_due.isdisjoint(range(self.num_rows)[rows]):
            return  # no page of these rows fills with this entry
        self._pages_after_one(pool, rows, self.lengths[rows] - 1)

    def _record(self, pool: SlotPool, ids: torch.Tensor, added: torch.Tensor | None, weights: torch.Tensor | None,
                rows: slice, pages: bool = True) -> None:
        """Put new (slot, position) rows ids [r, H, q, 2] after each head's last entry (``added`` [r, H] of
        them per head, left-aligned; None = all q); ``weights`` [r, H, q, C] (None: zeros). ``pages``: bring
        the page bounds up to date now (False: the keys are not written yet, see ``append_slots``)."""
        r, h, q, _ = ids.shape
        self._pages_due = None
        longest, uniform = self.span(rows)
        self._reserve(longest + q)
        if uniform and added is None:  # every head as long: the new entries go in one block of columns
            columns = slice(longest, longest + q)
            self.ids[rows, :, columns] = ids
            if self.weights is not None:
                self.weights[rows, :, columns] = 0.0 if weights is None else weights
        else:  # each head's new entries go right after its own last one
            index = self.lengths[rows].to(self.device)[..., None] + torch.arange(q, device=self.device)
            mask = None if added is None else torch.arange(q, device=self.device) < added.to(self.device)[..., None]
            _scatter_rows(self.ids[rows], index, ids, mask)
            if self.weights is not None:
                source = torch.zeros(r, h, q, len(self.columns), device=self.device) if weights is None else weights
                _scatter_rows(self.weights[rows], index, source, mask)
        before = self.lengths[rows].clone() if self.page_size else None  # only page bounds need it
        self.lengths[rows] += q if added is None else added
        if not (pages and self.page_size and before.numel()):
            return
        if q == 1 and added is None:
            self._pages_after_one(pool, rows, before)
        else:
            self._refresh_pages(pool, rows, int(before.min()))

    def _pages_after_one(self, pool: SlotPool, rows: slice, before: torch.Tensor) -> None:
        """The page bounds of ``rows`` after one entry per head came after their ``before`` [r, H] entries. What a read
        by bound needs are the bounds of full pages (Quest reads a head's open page, not yet full, whole), so a page's
        are computed once, when the entry that fills it comes; where the bounds have no room for it yet, from
        ``before`` on (the open pages too)."""
        counts = before.flatten().tolist()  # a few heads: plain numbers cost less than tensor operations
        if not counts:
            return
        if self.page_bounds is None or self.page_bounds.shape[2] * self.page_size <= max(counts):
            self._refresh_pages(pool, rows, min(counts))
            return
        filled = [n for n in counts if (n + 1) % self.page_size == 0]
        if filled:
            self._refresh_pages(pool, rows, min(filled))

    def _refresh_pages(self, pool: SlotPool, rows: slice, start: int = 0) -> None:
        """Recompute the page bounds of ``rows`` from column ``start`` on (the pages entries were added to or
        changed in), from the keys in the pool."""
        if not self.page_size:
            return
        size = self.page_size
        first = start // size
        longest, _ = self.span(rows)
        pages = -(-longest // size)
        if pages <= first:
            return
        slots = self.ids[rows, :, first * size : pages * size, 0]
        keys, _ = pool.gather(_padded(slots, (pages - first) * size, PAD_SLOT))
        columns = torch.arange(first * size, pages * size, device=self.device)
        valid = (columns < self.lengths[rows].to(self.device)[..., None])[..., None]  # [r, H, n, 1]
        r, h = slots.shape[:2]
        keys = keys.view(r, h, pages - first, size, -1)  # min and max of keys are keys: exact in their dtype
        valid = valid.view(r, h, pages - first, size, 1)
        low = keys.masked_fill(~valid, float("inf")).amin(3)
        high = keys.masked_fill(~valid, float("-inf")).amax(3)
        bounds = torch.stack([low, high], dim=3)  # [r, H, pages, 2, d]
        bounds = bounds.masked_fill(~valid.any(3, keepdim=True), 0.0)  # a page with no entry: zeros, never read
        needed = max(pages, -(-self.capacity // size))
        if self.page_bounds is None or self.page_bounds.shape[2] < needed:
            grown = torch.zeros(*self.ids.shape[:2], needed, 2, bounds.shape[-1], dtype=bounds.dtype, device=self.device)
            if self.page_bounds is not None:
                grown[:, :, : self.page_bounds.shape[2]] = self.page_bounds
            self.page_bounds = grown
        self.page_bounds[rows, :, first:pages] = bounds

    def _reserve(self, needed: int) -> None:
        """Make room for ``needed`` entries per head (doubling, so appends are amortized O(new))."""
        if needed > self.capacity:
            self._resize(max(needed, 2 * self.capacity, 16))

    def _resize(self, capacity: int) -> None:
        keep = min(capacity, self.capacity)
        ids = PAD_IDS.to(self.device).repeat(*self.ids.shape[:2], capacity, 1)
        ids[:, :, :keep] = self.ids[:, :, :keep]
        self.ids = ids
        if self.weights is not None:
            weights = torch.zeros(*self.weights.shape[:2], capacity, self.weights.shape[3], device=self.device)
            weights[:, :, :keep] = self.weights[:, :, :keep]
            self.weights = weights
        if self.page_bounds is not None:  # a page for every page_size columns of the table
            pages = -(-capacity // self.page_size)
            bounds = self.page_bounds.new_zeros(*self.page_bounds.shape[:2], pages, *self.page_bounds.shape[3:])
            kept = min(pages, self.page_bounds.shape[2])
            bounds[:, :, :kept] = self.page_bounds[:, :, :kept]
            self.page_bounds = bounds

    @_plain_tensors
    def relocate(self, pool: SlotPool, rows: Rows = None) -> None:
        """Move the plain entries of ``rows`` that this table alone holds into ascending slots, head after head, each
        head's in its order (``SlotPool.relocate``; coded entries and entries a fork shares stay where they are)."""
        rows = _all(rows)
        lengths = self.lengths[rows]
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest == 0:
            return
        slots = self.slots[rows, :, :longest]  # a view: the moved slots are written through to ``ids``
        held = torch.arange(longest, device=self.device) < lengths.to(self.device)[..., None]
        held &= (slots != PAD_SLOT) & ((slots >> TIER_SHIFT) == 0)
        where = held.nonzero()  # [k, 3], row-major: head after head, each head's entries in order
        old = slots[held].long()
        alone = (pool.refs[old.cpu()] == 1).to(self.device)
        where, old = where[alone], old[alone]
        moved = pool.relocate(old)
        slots[where[:, 0], where[:, 1], where[:, 2]] = moved.to(slots.device, torch.int32)

    @_plain_tensors
    def shrink(self) -> None:
        """Give back table memory beyond twice the longest head (after a prompt was compressed)."""
        longest, _ = self.span()
        if self.capacity > max(2 * longest, 16):
            self._resize(max(2 * longest, 16))

    @_plain_tensors
    def apply(self, pool: SlotPool, edit: Edit, rows: Rows = None) -> None:
        """Carry out a method's edit on ``rows`` (see ``Edit`` for the order)."""
        rows = _all(rows)
        if edit.replace is not None:
            self.release(pool, rows)
            self._replace(pool, edit.replace, rows)
        longest, _ = self.span(rows)
        if edit.rewrite is not None:
            self._rewrite(pool, edit.rewrite.mask, edit.rewrite.keys, edit.rewrite.values, rows, longest)
        if edit.log_weights is not UNCHANGED:
            self._set_column(self.LOG_WEIGHTS, edit.log_weights, rows, longest)
        for name, values in edit.channels.items():
            self._set_column(name, values, rows, longest)
        if edit.keep is not None:
            self.retain(pool, edit.keep, rows)

    def _set_column(self, name: str, values: torch.Tensor | None, rows: slice, length: int) -> None:
        """Set a weight column of ``rows`` ([r, H, L]; None removes it, for every row)."""
        if values is None:
            if name in self.columns:
                kept = [i for i, n in enumerate(self.columns) if n != name]
                self.columns = [self.columns[i] for i in kept]
                self.weights = self.weights[..., kept].contiguous() if kept else None
            return
        if name not in self.columns:
            fresh = torch.zeros(*self.ids.shape[:3], 1, device=self.device)
            self.weights = fresh if self.weights is None else torch.cat([self.weights, fresh], dim=-1)
            self.columns = [*self.columns, name]
        self.weights[rows, :, :length, self.columns.index(name)] = values[:, :, :length]

    def _replace(self, pool: SlotPool, entries: Entries, rows: slice) -> None:
        named = ({self.LOG_WEIGHTS: entries.log_weights} if entries.log_weights is not None else {}) | entries.channels
        for name in named:  # the columns the new entries bring
            if name not in self.columns:
                self._set_column(name, torch.zeros(1, 1, 0), rows, 0)
        weights = None
        if self.columns:
            shape = entries.positions.shape
            weights = torch.stack([named[n].float() if n in named else torch.zeros(shape, device=self.device)
                                   for n in self.columns], dim=-1)
        self._write(pool, entries.keys, entries.values, entries.positions, entries.valid.to(self.device), weights, rows)

    def _rewrite(self, pool: SlotPool, mask, keys, values, rows: slice, length: int) -> None:
        """New slots for the entries marked in ``mask`` [r, H, L] (keys, values [N, d] in mask order);
        the old slots are let go."""
        table = self.ids[rows, :, :length, 0]
        mask = mask.to(self.device)
        old = table[mask]
        if old.numel() != keys.shape[0]:
            raise ValueError(f"a rewrite marks {old.numel()} entries but carries {keys.shape[0]}")
        if old.numel() == 0:
            return
        new = pool.allocate(old.numel())
        pool.write(new, keys, values)
        table[mask] = new.to(torch.int32)
        pool.release(old)  # refuses padding (slot 0): only real entries can be rewritten
        if self.page_size:
            self._refresh_pages(pool, rows, int(mask.flatten(0, 1).any(0).nonzero()[0]))

    @_plain_tensors
    def retain(self, pool: SlotPool, keep: torch.Tensor, rows: Rows = None) -> None:
        """Keep the entries of ``rows`` marked in ``keep`` [r, H, L] (L = their longest head); free the
        others' slots."""
        rows = _all(rows)
        length = keep.shape[-1]
        keep = keep.to(self.device)
        first_change = None
        if self.page_size:  # pages before the first entry left out are unchanged
            valid = torch.arange(length, device=self.device) < self.lengths[rows].to(self.device)[..., None]
            dropped = (valid & ~keep).flatten(0, 1).any(0).nonzero()
            first_change = int(dropped[0]) if dropped.numel() else None
        weights = None if self.weights is None else self.weights[rows, :, :length]
        dropped_slots, counts = compact_rows(self.ids[rows, :, :length], weights, keep, self.lengths[rows])
        pool.release(dropped_slots)
        self.lengths[rows] = counts
        if first_change is not None:
            self._refresh_pages(pool, rows, first_change)

    @_plain_tensors
    def code(self, pool: SlotPool, tier: int, recent: int, rows: Rows = None, layer: int = -1) -> int:
        """Move plain entries of ``rows`` into ``tier``'s codec, in blocks of consecutive entries of one head,
        oldest first; each head's ``recent`` newest entries (and what falls short of a block) stay plain.
        Returns the entries coded. New blocks are written and the plain slots let go, so forks sharing
        them are untouched. A codec that codes a token over every head at once (``code_rows``: DeltaKV) does
        the coding itself, for rows of one ``layer``."""
        rows = _all(rows)
        codec = pool.tiers[tier - 1].codec
        if hasattr(codec, "code_rows"):
            coded = codec.code_rows(self, pool, tier, recent, rows, layer)
            if coded and self.page_size:
                self._refresh_pages(pool, rows)
            return coded
        size = codec.block_size
        longest, _ = self.span(rows)
        slots = self.ids[rows, :, :longest, 0]  # a view: written below
        columns = torch.arange(longest, device=self.device)
        limit = (self.lengths[rows] - recent).to(self.device)[..., None]
        plain = ((slots >> TIER_SHIFT) == 0) & (columns < limit)
        take = plain.sum(-1, keepdim=True) // size * size
        if not bool((take > 0).any()):
            return 0
        chosen = plain & (plain.cumsum(-1) <= take)
        old = slots[chosen]  # head by head, oldest first: whole blocks of one head each
        keys, values = pool.gather(old)
        d = keys.shape[-1]
        slots[chosen] = pool.encode(tier, keys.view(-1, size, d), values.view(-1, size, d)).reshape(-1).to(torch.int32)
        pool.release(old)
        if self.page_size:  # Quest's bounds follow the keys as they will be read
            self._refresh_pages(pool, rows, int(chosen.flatten(0, 1).any(0).nonzero()[0]))
        return old.numel()

    # ----- sharing -------------------------------------------------------------------------
    @_plain_tensors
    def share(self, pool: SlotPool, rows: Rows = None, page_size: int | None = None) -> SlotTable:
        """An independent table holding the same entries as ``rows`` (their slots get one more holder each);
        ``page_size`` (None: this table's) sets the twin's page bounds: 0 leaves them behind (a fork whose
        method does not read them), another size rebuilds them."""
        rows = _all(rows)
        twin = SlotTable.__new__(SlotTable)
        twin.device = self.device
        twin.ids = self.ids[rows].clone()
        twin.weights = None if self.weights is None else self.weights[rows].clone()
        twin.columns = list(self.columns)
        twin.lengths = self.lengths[rows].clone()
        twin.page_size = self.page_size if page_size is None else page_size
        twin.page_bounds = None
        pool.share(self.held_slots(rows))
        if twin.page_size == self.page_size and self.page_bounds is not None:
            twin.page_bounds = self.page_bounds[rows].clone()
        else:
            twin._refresh_pages(pool, slice(None))
        return twin

    @_plain_tensors
    def release(self, pool: SlotPool, rows: Rows = None) -> None:
        """Let go of every entry of ``rows`` (they are empty afterwards)."""
        rows = _all(rows)
        pool.release(self.held_slots(rows))
        self.ids[rows] = PAD_IDS.to(self.device)
        if self.weights is not None:
            self.weights[rows] = 0.0
        if self.page_bounds is not None:
            self.page_bounds[rows] = 0.0
        self.lengths[rows] = 0


class RowSummaries:
    """Summaries of consecutive groups of rows (None: nothing left there) as one ``Summary`` over all rows."""

    def __init__(self, parts: list, sizes: list[int]):
        self.parts, self.sizes = parts, sizes

    def readout(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts' affine maps stacked over the rows; rows with nothing left read nothing (log partition -inf)."""
        matrix, bias = next(summary.readout(scaling) for summary in self.parts if summary is not None)
        matrices, biases = [], []
        for summary, size in zip(self.parts, self.sizes):
            if summary is None:
                empty = bias.new_zeros(size, *bias.shape[1:])
                empty[..., -1] = float("-inf")
                matrices.append(matrix.new_zeros(size, *matrix.shape[1:]))
                biases.append(empty)
            else:
                part_matrix, part_bias = summary.readout(scaling)
                matrices.append(part_matrix)
                biases.append(part_bias)
        return torch.cat(matrices), torch.cat(biases)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.parts if s is not None)


def _pool_arrays(pool: SlotPool, blocks: Callable | None) -> Callable[[], tuple]:
    """``Pages.arrays``: the pool's plain keys and values as they are when read, and the coded blocks ``blocks`` makes (or None)."""
    return lambda: (pool.arrays["keys"], pool.arrays["values"], None if blocks is None else blocks())


def _row_spans(sizes: list[int], heads: int) -> list[int]:
    """Each row's longest head, of every head's length ``sizes`` (``heads`` a row)."""
    return [max(sizes[i : i + heads]) for i in range(0, len(sizes), heads)]


def _padded(array: torch.Tensor, length: int, fill) -> torch.Tensor:
    """[r, H, L, ...] → [r, H, length, ...] (``fill`` after each head's L columns)."""
    if array.shape[2] == length:
        return array
    out = torch.empty(*array.shape[:2], length, *array.shape[3:], dtype=array.dtype, device=array.device)
    out[...] = fill.to(array.device) if isinstance(fill, torch.Tensor) else fill
    out[:, :, : array.shape[2]] = array
    return out


def _all(rows: Rows) -> slice:
    return slice(None) if rows is None else rows


PAD_IDS = torch.tensor([PAD_SLOT, PAD_POSITION], dtype=torch.int32)  # (slot, position) of padding


def _aligned(flat: torch.Tensor, aligned: torch.Tensor, fill) -> torch.Tensor:
    """Rows [N, ...] laid out left-aligned per head where ``aligned`` [B, H, q] is True (``fill`` elsewhere)."""
    fill = fill.to(flat.device) if isinstance(fill, torch.Tensor) else fill
    out = torch.empty((*aligned.shape, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    out[...] = fill
    out[aligned] = flat
    return out


def compact_rows(ids: torch.Tensor, weights: torch.Tensor | None, keep: torch.Tensor, lengths: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows keeping the entries marked in ``keep`` [R, H, L], in place: per head, the entries at columns below its
    length ``lengths`` [R, H] (int64, CPU) that ``keep`` marks move to its first columns in order, with their ``weights``
    (float32 [R, H, L, C] or None), and every later column of the L becomes padding (weights 0). ``ids`` int32 [R, H, L, 2]
    (views of the table's arrays). Returns the slots left out (int64 [n] on the CPU, head after head, in column order)
    and each head's count kept (int64 [R, H], CPU).

    On the CPU with the compiled kernels, one pass (``csrc/compact_tables.cpp``); elsewhere ``compact_rows_torch``, the
    reference."""
    kernel = cpu_kernels() if ids.device.type == "cpu" else None
    if kernel is None:
        return compact_rows_torch(ids, weights, keep, lengths)
    dropped, counts = kernel.compact_tables(ids, NOTHING if weights is None else weights, keep.contiguous(), lengths.contiguous(),
                                            PAD_SLOT, PAD_POSITION)
    return dropped, counts


def compact_rows_torch(ids: torch.Tensor, weights: torch.Tensor | None, keep: torch.Tensor, lengths: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``compact_rows`` in plain PyTorch: the reference."""
    length = keep.shape[-1]
    valid = torch.arange(length, device=ids.device) < lengths.to(ids.device)[..., None]
    keep = keep & valid
    dropped = ids[..., 0][valid & ~keep].long().cpu()
    place = torch.where(keep, keep.cumsum(-1) - 1, length)[..., None]  # kept entries first, in order; the rest
    ids[...] = _compacted(ids, place, PAD_IDS.to(ids.device))              # to a spare column past the end
    if weights is not None:
        weights[...] = _compacted(weights, place, 0.0)
    return dropped, keep.sum(-1).cpu()


def _compacted(array: torch.Tensor, place: torch.Tensor, fill) -> torch.Tensor:
    """Rows [B, H, L, C] moved to column ``place`` [B, H, L, 1] (L: dropped), ``fill`` where nothing moved to. What
    ``_aligned(array[keep], ...)`` gives for a table's rows in place, by one scatter (a boolean gather and a masked
    write cost ~3.5× as much on a step's eviction)."""
    out = torch.empty((*array.shape[:2], array.shape[2] + 1, array.shape[3]), dtype=array.dtype, device=array.device)
    out[...] = fill
    return out.scatter_(2, place.expand_as(array), array)[:, :, :-1]


def _scatter_rows(array: torch.Tensor, index: torch.Tensor, source: torch.Tensor, mask: torch.Tensor | None) -> None:
    """array[b, h, index[b, h, j]] = source[b, h, j] (rows [..., C]) where ``mask`` [B, H, q] (None: all)."""
    if mask is None:
        array.scatter_(2, index[..., None].expand(*index.shape, array.shape[3]), source)
        return
    b_idx, h_idx, j_idx = mask.nonzero(as_tuple=True)
    array[b_idx, h_idx, index[b_idx, h_idx, j_idx]] = source[b_idx, h_idx, j_idx]


__all__ = ["PAD_SLOT", "TIER_SHIFT", "PoolExhausted", "SlotPool", "SlotTable"]
