"""The slot pool and slot tables: in-place appends, evictions that free slots, forks that share them."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import hugepages
from kvcompress.store.codecs import KiviCodec
from kvcompress.kernels import cpu_kernels
from kvcompress.store.slots import (LENGTH_BYTES, PAD_POSITION, PAD_SLOT, TIER_SHIFT, PoolExhausted, SlotPool, SlotTable, compact_rows_torch,
                                     distinct)
from kvcompress.store.view import Edit, Rewrite

DIM = 4


class Model:
    """What a table should hold, kept in plain Python: per (row, head) a list of (position, key value); the
    value is minus the entry's original key (coding changes keys by at most half a step, values of a constant
    entry not at all)."""

    def __init__(self, batch, heads):
        self.heads = [[[] for _ in range(heads)] for _ in range(batch)]


def _check(pool: SlotPool, tables: dict[int, SlotTable], models: dict[int, Model]) -> None:
    holders, blocks = Counter(), Counter()
    for table in tables.values():
        for entry in table.held_slots().tolist():
            if entry >> TIER_SHIFT:  # a coded entry: its block is held once per entry naming it
                blocks[entry >> TIER_SHIFT, (entry & (2**TIER_SHIFT - 1)) // pool.tiers[0].codec.block_size] += 1
            else:
                holders[entry] += 1
    refs = pool.refs
    for slot, count in holders.items():
        assert int(refs[slot]) == count  # every holder counted once: nothing leaked, nothing doubly owned
    for (tier, block), count in blocks.items():
        assert int(pool.tiers[tier - 1].refs[block]) == count
    free = set(pool._free[: pool._top].tolist())
    assert len(free) == pool._top  # no slot twice on the free list
    assert free.isdisjoint(holders) and 0 not in free
    assert pool.num_used == len(holders) == pool.capacity - len(free)  # every slot is held or free
    assert int(refs[list(free)].abs().sum()) == 0 if free else True
    store = pool.tiers[0]
    assert store.num_used == len(blocks)
    assert pool.used_bytes == len(holders) * pool.bytes_per_slot + len(blocks) * store.bytes_per_slot
    for key, table in tables.items():
        view = table.view(pool)
        model = models[key]
        for b, row in enumerate(model.heads):
            for h, entries in enumerate(row):
                n = int(table.lengths[b, h])
                assert n == len(entries)
                assert view.positions[b, h, :n].tolist() == [p for p, _, _ in entries]
                assert view.keys[b, h, :n, 0].tolist() == [float(k) for _, k, _ in entries]
                assert view.values[b, h, :n, 0].tolist() == [v for _, _, v in entries]
        held = table.held_slots()
        expected = pool.held_bytes(held) + held.numel() * (4 + 4) + table.lengths.numel() * LENGTH_BYTES
        if table.page_size:
            _check_page_bounds(table, view)
            pages = int(((table.lengths + table.page_size - 1) // table.page_size).sum())
            expected += pages * 2 * DIM * 4
        assert table.nbytes(pool) == expected


def _check_relocated(pool: SlotPool, table: SlotTable, before: torch.Tensor, rows, free: list[int]) -> None:
    """After ``relocate`` over ``rows`` (``free``: the free slots before it, ascending): the entries it may move (plain,
    held by this table alone) moved to the smallest free slots, ascending head after head, each head's in its order;
    every other entry, and every other row, where it was."""
    after = table.ids
    assert torch.equal(after[..., 1], before[..., 1])  # positions, and so the entries' order, unchanged
    moved_from, moved_to = [], []
    for row in range(table.num_rows):
        for h in range(table.num_heads):
            n = int(table.lengths[row, h])
            old, new = before[row, h, :n, 0].tolist(), after[row, h, :n, 0].tolist()
            for o, m in zip(old, new):
                if o >> TIER_SHIFT or int(pool.refs[m]) > 1 or row not in rows:
                    assert o == m  # coded, shared or outside the rows: not moved
                else:
                    moved_from.append(o)
                    moved_to.append(m)
    if not moved_from or len(moved_from) > len(free):  # nothing to move, or no room to move it without growing
        assert moved_from == moved_to
        return
    assert moved_to == free[: len(moved_to)]  # the smallest free slots, ascending, head after head


def _check_page_bounds(table: SlotTable, view) -> None:
    """Each full page's bounds are the channel-wise min and max of the keys it holds now (after any appends,
    evictions and rewrites); a head's open page, not yet full, is read whole and needs none."""
    size = table.page_size
    for b, row in enumerate(table.lengths.tolist()):
        for h, n in enumerate(row):
            for page in range(n // size):
                keys = view.keys[b, h, page * size : min(n, (page + 1) * size)]
                assert torch.equal(table.page_bounds[b, h, page, 0], keys.amin(0))
                assert torch.equal(table.page_bounds[b, h, page, 1], keys.amax(0))


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(0, 12), spare=st.integers(0, 3), columns=st.integers(0, 3),
       keep_share=st.sampled_from([0.0, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**16))
def test_the_compiled_compaction_equals_the_reference(rows, heads, length, spare, columns, keep_share, seed):
    """A table's rows keeping what a mask marks, compacted in place by the compiled pass, exactly as ``compact_rows_torch``
    does it: on views of longer tables (as ``retain`` hands them), with and without weight columns, ragged heads
    (columns past a head's length are padding, whatever the mask says there), keeping nothing to everything."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows, heads), generator=gen)
    ids = torch.randint(1, 1000, (rows, heads, length + spare, 2), generator=gen).int()
    weights = torch.randn(rows, heads, length + spare, columns, generator=gen) if columns else None
    keep = torch.rand(rows, heads, length, generator=gen) < keep_share
    expected_ids, expected_weights = ids.clone(), None if weights is None else weights.clone()
    expected = compact_rows_torch(expected_ids[:, :, :length], None if weights is None else expected_weights[:, :, :length], keep,
                                  lengths)
    dropped, counts = cpu_kernels().compact_tables(ids[:, :, :length], torch.empty(0) if weights is None else weights[:, :, :length],
                                                   keep, lengths, PAD_SLOT, PAD_POSITION)
    assert torch.equal(dropped, expected[0]) and torch.equal(counts, expected[1])
    assert torch.equal(ids, expected_ids) and (weights is None or torch.equal(weights, expected_weights))
    assert torch.equal(counts, (keep & (torch.arange(length) < lengths[..., None])).sum(-1))


OPS = st.lists(st.tuples(st.sampled_from(["append", "evict", "fork", "release", "rewrite", "code", "relocate"]), st.integers(0, 10**6)),
               min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, batch=st.integers(1, 2), heads=st.integers(1, 3), page_size=st.sampled_from([0, 1, 3, 4]))
def test_pool_invariants_under_random_appends_evictions_forks_and_releases(ops, batch, heads, page_size):
    """Two layers of rows (as a session keeps them); each operation acts on one layer's rows or on all.
    With pages (Quest's index), every page's key bounds stay those of the keys it holds. Coding (KIVI, in
    blocks of 2) moves entries into blocks: keys change within half a step, positions and values not."""
    pool = SlotPool(DIM, initial=8)  # small: the pool grows along the way
    tier = pool.tier(KiviCodec(4, 2))
    rows_total = 2 * batch
    tables, models = {0: SlotTable(rows_total, heads, page_size=page_size)}, {0: Model(rows_total, heads)}
    counter = {"position": 0, "value": 1.0, "next": 1}
    for op, seed in ops:
        gen = torch.Generator().manual_seed(seed)
        key = sorted(tables)[seed % len(tables)] if tables else None
        rows = [slice(0, batch), slice(batch, rows_total), None][seed % 3]
        picked = range(rows_total)[rows] if rows is not None else range(rows_total)
        r = len(picked)
        if op == "append" and key is not None:
            q = 1 + seed % 3
            values = counter["value"] + torch.arange(r * heads * q, dtype=torch.float32).view(r, heads, q)
            counter["value"] += r * heads * q
            positions = torch.arange(counter["position"], counter["position"] + q).expand(r, q)
            counter["position"] += q
            keys = values[..., None] * torch.linspace(1, -1, DIM)  # channels differ (page bounds per channel); channel 0 = value
            tables[key].append(pool, keys, -keys, positions, rows=rows)
            for i, row in enumerate(picked):
                for h in range(heads):
                    models[key].heads[row][h] += [(int(positions[i, j]), float(values[i, h, j]), -float(values[i, h, j]))
                                                  for j in range(q)]
        elif op == "evict" and key is not None:
            length, _ = tables[key].span(rows)
            keep = torch.rand(r, heads, length, generator=gen) < 0.6
            tables[key].apply(pool, Edit(keep=keep), rows)
            model = models[key]
            for i, row in enumerate(picked):
                model.heads[row] = [[e for j, e in enumerate(entries) if bool(keep[i, h, j])] for h, entries in enumerate(model.heads[row])]
        elif op == "fork" and key is not None:
            new = counter["next"]
            counter["next"] += 1
            tables[new] = tables[key].share(pool, page_size=[None, 0, 2][seed % 3])  # the same pages, none, rebuilt
            models[new] = Model(rows_total, heads)
            models[new].heads = [[list(entries) for entries in row] for row in models[key].heads]
        elif op == "release" and key is not None:
            if rows is None:
                tables.pop(key).release(pool)
                models.pop(key)
            else:
                tables[key].release(pool, rows)
                for row in picked:
                    models[key].heads[row] = [[] for _ in range(heads)]
        elif op == "rewrite" and key is not None:
            length, _ = tables[key].span(rows)
            mask = torch.rand(r, heads, length, generator=gen) < 0.3
            mask &= torch.arange(length) < tables[key].lengths[rows if rows is not None else slice(None)][..., None]  # real entries only
            new_values = torch.full((r, heads, length), 1000.0 + counter["value"])
            counter["value"] += 1
            keys = new_values[..., None].expand(r, heads, length, DIM)
            tables[key].apply(pool, Edit(rewrite=Rewrite(mask, keys[mask], -keys[mask])), rows)
            for i, row in enumerate(picked):
                for h, entries in enumerate(models[key].heads[row]):
                    for j, (position, _, _) in enumerate(entries):
                        if bool(mask[i, h, j]):
                            entries[j] = (position, float(new_values[i, h, j]), -float(new_values[i, h, j]))
        elif op == "code" and key is not None:
            tables[key].code(pool, tier, seed % 3, rows)
            view = tables[key].view(pool)
            for row in picked:
                for h, entries in enumerate(models[key].heads[row]):
                    if not entries:
                        continue
                    spread = max(k for _, k, _ in entries) - min(k for _, k, _ in entries)
                    for j, (position, k, v) in enumerate(entries):
                        decoded = float(view.keys[row, h, j, 0])
                        assert abs(decoded - k) <= spread / 30 * 1.01 + abs(k) * 2**-10  # half a 4-bit step
                        entries[j] = (position, decoded, v)
        elif op == "relocate" and key is not None:  # the same entries, in other slots
            before = tables[key].ids.clone()
            free = sorted(pool._free[: pool._top].tolist())
            tables[key].relocate(pool, rows)
            _check_relocated(pool, tables[key], before, picked, free)
        _check(pool, tables, models)
    for table in tables.values():
        table.release(pool)
    assert pool.num_used == 0 and int(pool.refs.sum()) == 0  # everything comes back
    assert pool.tiers[0].num_used == 0 and int(pool.tiers[0].refs.sum()) == 0


def test_relocation_moves_what_an_eviction_kept_to_the_smallest_free_slots_in_order():
    pool = SlotPool(DIM, initial=64)
    other, table = SlotTable(1, 2), SlotTable(1, 2)
    values = torch.arange(2 * 12, dtype=torch.float32).view(1, 2, 12, 1).expand(1, 2, 12, DIM)
    for t in (other, table):  # interleaved with another table's entries, as requests' prefills are
        t.append(pool, values[:, :, :6], -values[:, :, :6], torch.arange(6).expand(1, 6))
    table.append(pool, values[:, :, 6:], -values[:, :, 6:], torch.arange(6, 12).expand(1, 6))
    keep = torch.zeros(1, 2, 12, dtype=torch.bool)
    keep[..., ::3] = True  # every third entry kept: spread over the pool
    table.apply(pool, Edit(keep=keep))
    before, used, peak = table.view(pool), pool.num_used, pool.peak_bytes
    free = sorted(pool._free[: pool._top].tolist())
    table.relocate(pool)
    assert pool.peak_bytes == peak  # the move borrows free slots: the most bytes held stays as it was
    after = table.view(pool)
    assert torch.equal(after.keys, before.keys) and torch.equal(after.values, before.values)
    assert torch.equal(after.positions, before.positions)
    assert table.slots[0, :, :4].flatten().tolist() == free[:8]  # the smallest free slots, ascending, head after head
    assert pool.num_used == used  # the old slots free again


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 3), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), keep_share=st.floats(0.1, 0.9),
       fork=st.booleans(), rows=st.sampled_from([None, slice(0, 1), slice(1, 2)]), seed=st.integers(0, 2**16))
def test_relocation_keeps_every_entry_and_the_slot_accounting(heads, lengths, keep_share, fork, rows, seed):
    """Two layers' rows, their appends interleaved with another table's, then an eviction, perhaps a fork: a relocation
    moves the plain entries held once to the smallest free slots in order, and nothing else changes."""
    gen = torch.Generator().manual_seed(seed)
    pool = SlotPool(DIM, initial=8)
    pool.tier(KiviCodec(4, 2))  # (none of its blocks held: ``_check`` counts them)
    table, other = SlotTable(2, heads), SlotTable(2, heads)
    models = {0: Model(2, heads), 1: Model(2, heads)}
    position = 0
    for step, q in enumerate(lengths):
        for key, t in ((0, table), (1, other)):
            values = torch.randn(2, heads, q, generator=gen)
            keys = values[..., None] * torch.linspace(1, -1, DIM)
            t.append(pool, keys, -keys, torch.arange(position, position + q).expand(2, q))
            for row in range(2):
                for h in range(heads):
                    models[key].heads[row][h] += [(position + j, float(values[row, h, j]), -float(values[row, h, j])) for j in range(q)]
        position += q
    length, _ = table.span()
    keep = torch.rand(2, heads, length, generator=gen) < keep_share
    table.apply(pool, Edit(keep=keep))
    models[0].heads = [[[e for j, e in enumerate(entries) if bool(keep[row, h, j])] for h, entries in enumerate(models[0].heads[row])]
                       for row in range(2)]
    tables = {0: table, 1: other}
    if fork:
        tables[2], models[2] = table.share(pool), models[0]
    before, free = table.ids.clone(), sorted(pool._free[: pool._top].tolist())
    table.relocate(pool, rows)
    _check_relocated(pool, table, before, range(2)[rows] if rows is not None else range(2), free)
    _check(pool, tables, models)
    held = int(table.lengths[rows if rows is not None else slice(None)].sum())
    assert (not torch.equal(table.ids, before)) == (not fork and 0 < held <= len(free))  # a fork holds every entry twice


def test_relocation_counts_no_byte_more_than_is_held():
    pool = SlotPool(DIM, initial=32)
    table = SlotTable(1, 1)
    values = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 1, 8, DIM)
    table.append(pool, values, -values, torch.arange(8).expand(1, 8))
    table.apply(pool, Edit(keep=torch.arange(8).view(1, 1, 8) != 3))  # 7 kept: moved, 14 slots at once
    peak = pool.peak_bytes
    assert peak == 8 * pool.bytes_per_slot
    table.relocate(pool)
    assert pool.peak_bytes == peak and pool.num_used == 7


def test_relocation_leaves_shared_and_coded_entries_and_a_full_pool_alone():
    pool = SlotPool(DIM, capacity=12, initial=12)
    table = SlotTable(1, 1)
    values = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 1, 8, DIM)
    table.append(pool, values, -values, torch.arange(8).expand(1, 8))
    table.apply(pool, Edit(keep=torch.arange(8).view(1, 1, 8) % 2 == 0))
    twin = table.share(pool)
    before = table.slots[0, 0, :4].clone()
    table.relocate(pool)  # every entry shared with the fork: none moves
    assert torch.equal(table.slots[0, 0, :4], before)
    twin.release(pool)
    filler = SlotTable(1, 1)
    filler.append(pool, values[:, :, :6], -values[:, :, :6], torch.arange(6).expand(1, 6))  # 10 of 12 slots held
    table.relocate(pool)  # 4 entries, 2 free slots: no room to move them within the budget, nothing changes
    assert torch.equal(table.slots[0, 0, :4], before) and pool.num_used == 10
    coded = SlotPool(DIM, initial=16)
    tier = coded.tier(KiviCodec(4, 2))
    table = SlotTable(1, 1)
    table.append(coded, values, -values, torch.arange(8).expand(1, 8))
    table.code(coded, tier, 2)
    before = table.slots[0, 0, :8].clone()
    table.relocate(coded)
    moved = table.slots[0, 0, :8]
    assert torch.equal(moved[:6], before[:6]) and bool((moved[:6] >> TIER_SHIFT).all())  # the coded entries stay in their tier


def test_a_rewrite_never_shows_in_a_fork():
    pool = SlotPool(DIM)
    table = SlotTable(1, 1)
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 1, 6, DIM)
    table.append(pool, keys, keys, torch.arange(6).expand(1, 6))
    twin = table.share(pool)
    mask = torch.zeros(1, 1, 6, dtype=torch.bool)
    mask[..., 2] = True
    twin.apply(pool, Edit(rewrite=Rewrite(mask, torch.full((1, DIM), 99.0), torch.full((1, DIM), 99.0))))
    assert table.view(pool).keys[0, 0, 2, 0] == 2.0 and twin.view(pool).keys[0, 0, 2, 0] == 99.0
    assert pool.num_used == 7  # six shared slots plus the fork's own rewritten one


def test_append_writes_only_the_new_entries():
    pool = SlotPool(DIM)
    table = SlotTable(1, 2)
    table.append(pool, torch.zeros(1, 2, 10, DIM), torch.zeros(1, 2, 10, DIM), torch.arange(10).expand(1, 10))
    before_slots = table.slots.clone()
    assert table.capacity >= 11
    before_arrays = pool.arrays["keys"].clone()
    table.append(pool, torch.ones(1, 2, 1, DIM), torch.ones(1, 2, 1, DIM), torch.tensor([[10]]))
    assert torch.equal(table.slots[:, :, :10], before_slots[:, :, :10])  # the old entries stay where they were
    changed = (pool.arrays["keys"][: before_arrays.shape[0]] != before_arrays).any(-1).nonzero().flatten().tolist()
    assert changed == table.slots[0, :, 10].tolist()  # only the two new slots were written


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(2, 3), tokens=st.integers(2, 12), seed=st.integers(0, 2**16))
def test_a_prompts_rows_append_as_their_copy_does(rows, heads, tokens, seed):
    """Entries that come as a prompt's rows (keys [r, H, q, d] a view of [r, q, H, d], as the engine's forward gives them)
    are written in that order with no copy first: the same slots, ids and entries as the same entries made contiguous."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(rows, tokens, heads, DIM, generator=g).transpose(1, 2) for _ in range(2))
    positions = torch.arange(tokens).expand(rows, tokens)
    made = []
    for k, v in ((keys, values), (keys.contiguous(), values.contiguous())):
        pool, table = SlotPool(DIM), SlotTable(rows, heads)
        table.append(pool, k, v, positions)
        view = table.view(pool)
        made.append((table.slots.clone(), view.keys, view.values, view.positions))
    assert not keys.is_contiguous()
    for a, b in zip(*made):
        assert torch.equal(a, b)
    assert torch.equal(made[0][1][..., :tokens, :], keys) and torch.equal(made[0][2][..., :tokens, :], values)


def test_fixed_pool_refuses_without_touching_anything():
    pool = SlotPool(DIM, capacity=10)
    table = SlotTable(1, 2)
    table.append(pool, torch.zeros(1, 2, 4, DIM), torch.zeros(1, 2, 4, DIM), torch.arange(4).expand(1, 4))
    with pytest.raises(PoolExhausted, match="2 free slots, 4 are needed"):
        table.append(pool, torch.zeros(1, 2, 2, DIM), torch.zeros(1, 2, 2, DIM), torch.arange(4, 6).expand(1, 2))
    assert table.lengths.tolist() == [[4, 4]] and pool.num_used == 8 and pool.capacity == 10
    table.release(pool)
    assert pool.num_free == 10


def test_a_fixed_pools_coded_tiers_draw_on_its_byte_budget():
    """Plain slots and coded blocks share one budget: coding frees plain room, a block past the budget is
    refused with nothing touched, and the arrays grow only up to the budget."""
    codec = KiviCodec(2, 4)
    pool = SlotPool(DIM, capacity=40, initial=4)
    tier = pool.tier(codec)
    table = SlotTable(1, 2)
    keys = torch.randn(1, 2, 12, DIM)
    table.append(pool, keys, keys, torch.arange(12).expand(1, 12))
    assert pool.num_used == 24 and pool.num_free == 16 and pool.capacity_bytes == 40 * pool.bytes_per_slot
    table.code(pool, tier, recent=0)  # its blocks are written before the plain slots go: they must fit beside them
    block = pool.tiers[0].bytes_per_slot
    assert pool.num_used == 0 and pool.used_bytes == 6 * block  # 2 heads × 12 entries in blocks of 4
    assert pool.num_free == (40 * pool.bytes_per_slot - 6 * block) // pool.bytes_per_slot > 16  # coding made room
    free, too_many = pool.num_free, (40 * pool.bytes_per_slot - pool.used_bytes) // block + 1
    with pytest.raises(PoolExhausted):
        pool.encode(tier, torch.zeros(too_many, 4, DIM), torch.zeros(too_many, 4, DIM))
    assert pool.used_bytes == 6 * block and int(pool.tiers[0].refs.sum()) == 6 * 4  # nothing touched
    plain = pool.allocate(free)
    assert pool.num_free == 0 and pool.refs.shape[0] - 1 <= 40  # the arrays stopped at the budget
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.release(plain)
    grown, held = pool.allocated_bytes, table.view(pool).keys.clone()
    pool.trim()  # something is still held: nothing changes
    assert pool.allocated_bytes == grown and torch.equal(table.view(pool).keys, held)
    table.release(pool)
    assert pool.used_bytes == 0 and pool.num_free == 40 and pool.peak_bytes <= 40 * pool.bytes_per_slot
    pool.trim()
    plain = (pool.refs.shape[0] - 1 if pool._reserved is not None else 4) * pool.bytes_per_slot  # one mapping: kept
    assert pool.allocated_bytes == plain + 64 * block <= grown  # the tier (and a pool not in one mapping) at its first size
    assert pool.peak_allocated >= grown
    again = SlotTable(1, 2)
    again.append(pool, keys, keys, torch.arange(12).expand(1, 12))  # and it grows again
    assert torch.equal(again.view(pool).keys, keys)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=6, max_size=6), steps=st.integers(1, 12), page_size=st.sampled_from([1, 3, 4]),
       seed=st.integers(0, 10**6))
def test_entries_recorded_before_their_keys_get_the_page_bounds_of_an_append(lengths, steps, page_size, seed):
    """The engine's step: ``append_slots`` records a slot per head of every row (a layer each), each row's keys are
    written there afterwards, then ``written`` for that row; the full pages' bounds equal those of appending the same
    keys, and the keys' min and max (ragged heads and rows, pages that start or fill, rows with no page to change)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 3
    pool, engine, plain = SlotPool(DIM), SlotTable(rows, 2, page_size=page_size), SlotTable(rows, 2, page_size=page_size)
    lengths = torch.tensor(lengths).view(rows, 2)
    longest = int(lengths.max())
    prompt = torch.randn(rows, 2, longest, DIM, generator=gen)
    keep = torch.arange(longest) < lengths[..., None]  # ragged heads: the first lengths[r, h] kept
    for table in (engine, plain):
        table.append(pool, prompt, prompt, torch.arange(longest).expand(rows, longest))
        if longest:
            table.apply(pool, Edit(keep=keep))
    for step in range(steps):
        keys = torch.randn(rows, 2, 1, DIM, generator=gen)
        position = torch.full((rows, 1), 100 + step)
        plain.append(pool, keys, keys, position)
        slots = pool.allocate(rows * 2).view(rows, 2, 1)
        engine.append_slots(pool, slots, position)
        for r in range(rows):  # layer by layer, as a forward writes them
            pool.write(slots[r].reshape(-1), keys[r].reshape(2, DIM), keys[r].reshape(2, DIM))
            engine.written(pool, slice(r, r + 1))
        assert torch.equal(engine.lengths, plain.lengths)
        for r in range(rows):
            for h in range(2):
                full = int(plain.lengths[r, h]) // page_size
                assert torch.equal(engine.page_bounds[r, h, :full], plain.page_bounds[r, h, :full]), (step, r, h)
        _check_page_bounds(engine, engine.view(pool))


@settings(max_examples=60, deadline=None)
@given(tables=st.integers(1, 4), layers=st.integers(1, 3), heads=st.integers(1, 3), data=st.data(), seed=st.integers(0, 2**16))
def test_a_steps_entries_recorded_at_once_equal_those_recorded_table_by_table(tables, layers, heads, data, seed):
    """``SlotTable.append_step`` (the compiled pass where it can, ``append_slots`` elsewhere) leaves every table as
    ``append_slots`` table by table does: ragged heads, log-weights and channels (new entries' 0), tables full to their
    capacity (grown), page bounds to follow (Quest's), empty heads. (Each table of a pair holds its own slots.)"""
    gen = torch.Generator().manual_seed(seed)
    pool = SlotPool(DIM, initial=8)
    pairs = []
    for _ in range(tables):
        length, page_size = data.draw(st.integers(0, 9)), data.draw(st.sampled_from([0, 0, 2]))
        made = [SlotTable(layers, heads, page_size=page_size) for _ in range(2)]
        keys = torch.randn(layers, heads, length, DIM, generator=gen)
        keep = torch.rand(layers, heads, length, generator=gen) < data.draw(st.sampled_from([0.5, 1.0]))
        weights = torch.randn(layers, heads, length, generator=gen) if data.draw(st.booleans()) else None
        for table in made:
            table.append(pool, keys, keys, torch.arange(length).expand(layers, length))
            if length:
                table.apply(pool, Edit(keep=keep, channels={} if weights is None else {SlotTable.LOG_WEIGHTS: weights, "score": -weights}))
        pairs.append(made)
    before = [made[0].ids.clone() for made in pairs]
    slots = pool.allocate(2 * tables * layers * heads).view(2, tables, layers, heads)
    positions = [int(p) for p in torch.randint(0, 2**20, (tables,), generator=gen)]
    for made, own, position in zip(pairs, slots[1], positions):
        made[1].append_slots(pool, own[:, :, None], torch.full((layers, 1), position, dtype=torch.int32))
    SlotTable.append_step(pool, [made[0] for made in pairs], slots[0], positions)
    for t, (at_once, alone) in enumerate(pairs):
        assert torch.equal(at_once.lengths, alone.lengths) and at_once.capacity >= int(at_once.lengths.max())
        span = int(alone.lengths.max())
        ids, reference = at_once.ids[:, :, :span], alone.ids[:, :, :span]
        assert torch.equal(ids[..., 1], reference[..., 1])  # the positions
        last = (alone.lengths - 1)[..., None]  # each head's new entry: the slot it was given, where append_slots put its own
        assert torch.equal(ids[..., 0].gather(-1, last)[..., 0], slots[0, t].int())
        assert torch.equal(reference[..., 0].gather(-1, last)[..., 0], slots[1, t].int())
        width = min(span, before[t].shape[2])
        held = torch.arange(width) < last  # the entries before it: as they were
        assert torch.equal(ids[:, :, :width][held], before[t][:, :, :width][held])
        assert (at_once.weights is None) == (alone.weights is None)
        if alone.weights is not None:
            valid = torch.arange(span) < alone.lengths[..., None]
            assert torch.equal(at_once.weights[:, :, :span][valid], alone.weights[:, :, :span][valid])
        assert (at_once.page_bounds is None) == (alone.page_bounds is None) and at_once._pages_due == alone._pages_due


@pytest.mark.skipif(cpu_kernels() is None, reason="the compiled CPU kernels are not built")
def test_a_steps_record_refuses_a_bad_slot_before_writing_any_table():
    pool, tables = SlotPool(DIM), [SlotTable(2, 1), SlotTable(2, 1)]
    for table in tables:
        table.append(pool, torch.randn(2, 1, 3, DIM), torch.randn(2, 1, 3, DIM), torch.arange(3).expand(2, 3))
        table._reserve(8)
    slots = pool.allocate(4).view(2, 2, 1)
    bad = slots.clone()
    bad[1, 1, 0] = 0  # slot 0 is a hole, never a new entry's
    before = [table.ids.clone() for table in tables]
    with pytest.raises(RuntimeError, match="int32 id above 0"):
        SlotTable.append_step(pool, tables, bad, [3, 3])
    assert all(torch.equal(table.ids, ids) for table, ids in zip(tables, before))
    assert all(int(table.lengths.sum()) == 6 for table in tables)


@pytest.mark.skipif(not hugepages.advises(), reason="a fixed pool maps its whole budget only where huge pages can be advised")
def test_a_fixed_cpu_pool_grows_within_one_mapping_and_keeps_it_when_idle():
    """A fixed CPU pool's arrays are the first slots of one mapping as large as its budget: growing moves nothing (the
    arrays keep their address and every held entry), the bytes counted are the slots the arrays hold, and an idle trim
    keeps them (the next load would fault the pages in again); a growable pool's trim still returns to its first size."""
    dim = 256  # a slot's key: 1 KiB, so the budget spans several 2 MiB pages
    pool = SlotPool(dim, capacity=8192, initial=16)
    address = {name: array.data_ptr() for name, array in pool.arrays.items()}
    first = pool.allocate(10)
    pool.write(first, torch.ones(10, dim), torch.full((10, dim), 2.0))
    more = pool.allocate(5000)  # past the first size: the arrays grow
    pool.write(more, torch.full((5000, dim), 3.0), torch.full((5000, dim), 4.0))
    grown = pool.refs.shape[0]
    assert grown > 5010 and all(pool.arrays[name].data_ptr() == address[name] for name in address)
    assert pool.allocated_bytes == (grown - 1) * pool.bytes_per_slot
    keys, values = pool.gather(first)
    assert bool((keys == 1).all()) and bool((values == 2).all())
    pool.release(torch.cat([first, more]))
    pool.trim()
    assert pool.refs.shape[0] == grown and pool.allocated_bytes == (grown - 1) * pool.bytes_per_slot and pool.num_free == 8192
    again = pool.allocate(5010)
    assert pool.refs.shape[0] == grown and set(again.tolist()) == set(torch.cat([first, more]).tolist())  # the same slots
    growable = SlotPool(dim, initial=16)
    growable.release(growable.allocate(100))
    growable.trim()
    assert growable.allocated_bytes == 16 * growable.bytes_per_slot


def test_a_fixed_pool_the_system_will_not_map_whole_grows_as_before(monkeypatch):
    """Where the budget's mapping is refused (a system that will not overcommit that much), the pool's arrays grow
    from their first size, copying what they hold, with the same entries and bytes counted."""
    import kvcompress.store.slots as slots

    real = slots.hugepages.zeros
    monkeypatch.setattr(slots.hugepages, "advises", lambda: True)
    monkeypatch.setattr(slots.hugepages, "zeros", lambda *shape, **kw: (_ for _ in ()).throw(OSError("no memory"))
                        if shape[0] == 4097 else real(*shape, **kw))
    pool = SlotPool(DIM, capacity=4096, initial=8)
    assert pool._reserved is None and pool.arrays["keys"].shape[0] == 9
    held = pool.allocate(6)
    pool.write(held, torch.ones(6, DIM), torch.full((6, DIM), 2.0))
    pool.allocate(100)  # grows, copying
    assert pool.arrays["keys"].shape[0] == pool.refs.shape[0] > 106
    keys, values = pool.gather(held)
    assert bool((keys == 1).all()) and bool((values == 2).all())


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), holders=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_the_free_stack_read_off_the_holders_counts_is_the_stack_sorted(sizes, holders, seed):
    """``_sort_free`` (what a relocation takes the smallest free slots from) gives the free stack sorted, the smallest on
    top, after allocations that grow the pool and releases in any order, of slots held once or twice."""
    gen = torch.Generator().manual_seed(seed)
    pool = SlotPool(DIM, initial=16)
    held = [pool.allocate(n, holders=holders) for n in sizes]
    for slots in held[::2]:
        pool.release(slots[torch.randperm(slots.numel(), generator=gen)])
    expected = pool._free[: pool._top].sort(descending=True).values
    pool._sort_free()
    assert torch.equal(pool._free[: pool._top], expected)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.integers(0, 2**31), max_size=300), repeats=st.integers(1, 3))
def test_distinct_is_torch_unique(values, repeats):
    """The slots a release frees, told apart by numpy's sort: torch.unique's values in its order, duplicates or none."""
    index = torch.tensor(values * repeats, dtype=torch.long)[torch.randperm(len(values) * repeats)]
    got = distinct(index)
    assert got.dtype == torch.long and torch.equal(got, torch.unique(index))
