"""Codecs: KIVI's quantization bound per group, bit packing, and coded entries in the slot pool."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.store.codecs import KiviCodec, pack, unpack
from kvcompress.store.slots import TIER_SHIFT, SlotPool, SlotTable


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 4]), shape=st.tuples(st.integers(1, 3), st.integers(1, 4)), seed=st.integers(0, 10**6))
def test_pack_and_unpack_round_trip(bits, shape, seed):
    codes = torch.randint(0, 2**bits, (*shape, 8), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (*shape, 8 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def _exact_step(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The float32 quantization step of x's groups along ``dim`` (the codec's 16-bit step is never smaller)."""
    return (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / (2**bits - 1)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4]), group=st.sampled_from([4, 8, 12]), blocks=st.integers(1, 3),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), param=st.sampled_from([torch.float16, torch.bfloat16]),
       seed=st.integers(0, 10**6))
def test_kivi_round_trip_error_is_within_half_a_step_per_group(bits, group, blocks, scale, param, seed):
    """Keys per channel over a block's entries, values per entry over channel groups: every number comes
    back within half its group's step (the step the codec stored, ≥ the exact one), codes within range."""
    gen = torch.Generator().manual_seed(seed)
    d = 8
    keys = torch.randn(blocks, group, d, generator=gen) * scale
    keys[..., 0] *= 20  # an outlier channel keeps its own scale
    values = torch.randn(blocks, group, d, generator=gen) * scale
    codec = KiviCodec(bits, group, param)
    rows = codec.encode(keys, values)
    k, v = codec.decode(rows, torch.arange(blocks * group))
    key_step = rows["key_scale"].float()[:, None, :]  # [blocks, 1, d]
    assert bool((key_step >= _exact_step(keys, bits, 1) * (1 - 1e-6)).all())
    assert bool(((k.view_as(keys) - keys).abs() <= key_step / 2 + 1e-6 * scale).all())
    c = codec.channel_group(d)
    value_step = rows["value_scale"].float().repeat_interleave(c, dim=-1)  # [blocks, group, d]
    assert bool(((v.view_as(values) - values).abs() <= value_step / 2 + 1e-6 * scale).all())
    assert bool((unpack(rows["key_codes"], bits) <= 2**bits - 1).all())


def test_kivi_reconstructs_a_constant_group_exactly_and_refuses_bad_settings():
    codec = KiviCodec(2, 4)
    keys = torch.full((1, 4, 8), 3.0)
    rows = codec.encode(keys, -keys)
    k, v = codec.decode(rows, torch.arange(4))
    assert torch.equal(k, keys[0]) and torch.equal(v, -keys[0])
    with pytest.raises(ValueError, match="2 or 4 bits"):
        KiviCodec(3)
    with pytest.raises(ValueError, match="group_size"):
        KiviCodec(2, 0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=2, max_size=4), recent=st.integers(0, 5), seed=st.integers(0, 10**6))
def test_coding_a_table_keeps_positions_frees_plain_slots_and_counts_whole_blocks(lengths, recent, seed):
    """``SlotTable.code`` moves every head's oldest plain entries into blocks (``recent`` stay plain),
    keeps positions and order, decodes within KIVI's bound, and lets plain slots go; a fork keeps its
    plain entries; releasing everything returns every slot and block; bytes count whole blocks."""
    gen = torch.Generator().manual_seed(seed)
    pool, size, d = SlotPool(8, initial=4), 2, 8
    tier = pool.tier(KiviCodec(4, size))
    heads = len(lengths)
    table = SlotTable(1, heads)
    longest = max(lengths)
    keys = torch.randn(1, heads, longest, d, generator=gen)
    valid = torch.arange(longest) < torch.tensor(lengths)[:, None]
    positions = torch.arange(longest)[None].expand(heads, longest)
    table._write(pool, keys, keys * 2, positions[None], valid[None], None, slice(None))
    twin = table.share(pool)
    before = table.view(pool)
    _ = before.keys  # materialized now: a view loads lazily from the table as it is then
    coded = table.code(pool, tier, recent)
    expected = sum((max(n - recent, 0) // size) * size for n in lengths)
    assert coded == expected
    after = table.view(pool)
    assert torch.equal(after.positions, before.positions) and torch.equal(table.lengths, twin.lengths)
    ids = table.ids[0, :, :, 0]
    for h, n in enumerate(lengths):
        code = (max(n - recent, 0) // size) * size
        assert bool((ids[h, :code] >> TIER_SHIFT == tier).all()) and bool((ids[h, code:n] >> TIER_SHIFT == 0).all())
        assert torch.equal(after.keys[0, h, code:n], before.keys[0, h, code:n])  # plain entries untouched
        blocks = keys[0, h, :code].view(-1, size, d)
        step = (blocks.amax(1, keepdim=True) - blocks.amin(1, keepdim=True)) / 15
        step = step + blocks.abs().amax(1, keepdim=True) * 2**-10  # the zero point rounded down to float16
        assert bool(((after.keys[0, h, :code].view(-1, size, d) - blocks).abs() <= step / 2 * 1.01 + 1e-6).all())
    assert torch.equal(twin.view(pool).keys, before.keys)  # the fork still reads its plain entries
    store = pool.tiers[tier - 1]
    assert store.num_used == expected // size and pool.num_used == sum(lengths)  # plain slots held by the twin only
    assert table.nbytes(pool) == (sum(lengths) - expected) * pool.bytes_per_slot + (expected // size) * store.bytes_per_slot \
        + sum(lengths) * 8 + heads * 8
    keep = torch.rand(1, heads, longest, generator=gen) < 0.5  # an eviction inside blocks: a block stays while one entry does
    table.retain(pool, keep)
    named = {int(i) >> TIER_SHIFT << TIER_SHIFT | (int(i) & (2**TIER_SHIFT - 1)) // size for i in table.held_slots() if int(i) >> TIER_SHIFT}
    assert store.num_used == len(named)
    twin.release(pool)
    table.release(pool)
    assert pool.num_used == 0 and store.num_used == 0 and int(store.refs.sum()) == 0 and int(pool.refs.sum()) == 0
