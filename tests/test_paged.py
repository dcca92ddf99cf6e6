"""The in-place decoding read (read/paged.py): the compiled CPU kernel and the plain PyTorch path against the
float32 reference read, over ragged heads, GQA groups, holes, log-weights and storage dtypes; and the
store's views handing their entries over in place only where they are plain."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.read import read
from kvcompress.read.paged import cpu_kernel, paged_decode, paged_decode_torch
from kvcompress.read.reference import read_reference
from kvcompress.store.codecs import KiviCodec
from kvcompress.store.slots import SlotPool, SlotTable
from kvcompress.store.view import KVView

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


def test_the_cpu_kernel_is_built():
    """The test machine compiles the kernel (make setup builds it): the tests below test it, not the fallback."""
    assert cpu_kernel() is not None


def _case(seed: int, rows: int, heads: int, groups: int, dim: int, lengths: list[int], hole_rate: float, weighted: bool,
          dtype: torch.dtype):
    """A pool of random entries and per-row slot tables (strided views of (slot, position) pairs, with spare
    columns), some entries holes (slot 0); and the same entries laid out densely for the reference."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.long).view(rows, heads)
    longest = int(lengths.max())
    total = int(lengths.sum())
    slots_free = torch.randperm(total + 7, generator=gen)[:total] + 1  # anywhere in the pool, never slot 0
    keys = torch.randn(total + 8, dim, generator=gen).to(dtype)
    values = torch.randn(total + 8, dim, generator=gen).to(dtype)
    pairs = torch.zeros(rows, heads, longest + 5, 2, dtype=torch.int32)
    span = torch.arange(longest)
    valid = span < lengths[..., None]  # [R, H, L]
    holes = (torch.rand(rows, heads, longest, generator=gen) < hole_rate) & valid
    pairs[:, :, :longest, 0][valid] = slots_free.int()
    pairs[:, :, :longest, 0][holes] = 0
    weights = torch.randn(rows, heads, longest + 5, 3, generator=gen) if weighted else None  # column 1: the log-weights
    query = torch.randn(rows, heads * groups, dim, generator=gen)
    capacity = [int(lengths[r].max()) + r for r in range(rows)]  # each row's table as wide as its own longest head (+ r)
    tables = [pairs[r, :, : capacity[r], 0] for r in range(rows)]
    log_weights = [weights[r, :, : capacity[r], 1] for r in range(rows)] if weighted else None
    index = pairs[:, :, :longest, 0].long()
    bias = torch.zeros(rows, heads, longest) if weights is None else weights[:, :, :longest, 1]
    view = KVView.of(keys[index].float(), values[index].float(), torch.zeros(rows, heads, longest, dtype=torch.long), valid=valid,
                     log_weights=bias.masked_fill(holes, -math.inf))  # a hole: a weight of zero for the reference
    return query, keys, values, tables, lengths, log_weights, view


CASES = dict(rows=st.integers(1, 3), heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 7]), dim=st.sampled_from([8, 64]),
             data=st.data(), hole_rate=st.sampled_from([0.0, 0.3, 1.0]), weighted=st.booleans(),
             dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(**CASES)
def test_paged_decode_equals_the_reference_read(rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed):
    """Ragged heads across the kernel's blocks (64) and chunks (512), holes anywhere, log-weights, GQA: out and lse
    equal the float32 reference over the same (stored) entries; a head with nothing to read gives 0 and -inf."""
    _check_against_reference((paged_decode, paged_decode_torch), rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed)


@settings(max_examples=12, deadline=None)
@given(**CASES)
def test_the_triton_read_equals_the_reference_read(rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed):
    """The GPU kernel, run by Triton's interpreter on the CPU (the suite sets TRITON_INTERPRET=1 without a GPU)."""
    triton_read = pytest.importorskip("kvcompress.read.paged_triton").paged_decode_triton
    _check_against_reference((triton_read,), rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed)


def _check_against_reference(reads, rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed):
    lengths = data.draw(st.lists(st.sampled_from([0, 1, 5, 63, 64, 65, 511, 513, 1100]), min_size=rows * heads, max_size=rows * heads))
    query, keys, values, tables, lengths, log_weights, view = _case(seed, rows, heads, groups, dim, lengths, hole_rate, weighted, dtype)
    scaling = 1 / math.sqrt(dim)
    ref_out, ref_lse, _ = read_reference(query[:, :, None], torch.ones(rows, 1, dtype=torch.long), view, scaling)
    for fn in reads:
        out, lse = fn(query, keys, values, tables, lengths, log_weights, scaling)
        assert out.shape == query.shape and lse.shape == query.shape[:2] and lse.dtype == torch.float32
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse[:, :, 0])), fn.__name__
        finite = torch.isfinite(lse)
        assert torch.allclose(lse[finite], ref_lse[:, :, 0][finite], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]), fn.__name__
        assert torch.allclose(out, ref_out[:, :, 0], atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]), fn.__name__
        assert bool((out[~finite] == 0).all())


def test_a_slot_outside_the_pool_is_refused():
    query, keys, values, tables, lengths, _, _ = _case(0, 1, 1, 1, 8, [10], 0.0, False, torch.float32)
    tables[0][0, 3] = keys.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode(query, keys, values, tables, lengths, None, 1.0)


def test_a_view_reads_in_place_only_while_its_entries_are_plain():
    """A table's view carries pages (no copy of the entries) until one of its entries is coded (KIVI): then the
    decoding read gathers and decodes as before, and both reads agree with the reference."""
    torch.manual_seed(0)
    pool, table = SlotPool(16), SlotTable(1, 2)
    table.append(pool, torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16), torch.arange(80)[None])
    query, positions = torch.randn(1, 4, 1, 16), torch.tensor([[80]])
    view = table.view(pool)
    assert view.pages is not None and view.pages.tables[0].data_ptr() == table.ids.data_ptr()  # the table itself
    paged = read(query, positions, view, 0.25)
    reference, lse, _ = read_reference(query, positions, view, 0.25)
    assert torch.allclose(paged.out, reference, atol=1e-5) and torch.allclose(paged.lse, lse, atol=1e-5)
    table.code(pool, pool.tier(KiviCodec(bits=4, group_size=32)), recent=16)
    coded = table.view(pool)
    assert coded.pages is None
    reference, _, _ = read_reference(query, positions, coded, 0.25)
    assert torch.allclose(read(query, positions, coded, 0.25).out, reference, atol=1e-5)


def test_a_selection_reads_only_the_chosen_entries_in_place():
    """Dynamic selection (Quest, OmniKV) on pages: the chosen entries, holes (-1) skipped, as the reference reads them."""
    torch.manual_seed(1)
    pool, table = SlotPool(16), SlotTable(2, 2)
    table.append(pool, torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16), torch.arange(40).expand(2, 40))
    query, positions = torch.randn(2, 2, 1, 16), torch.tensor([[40], [40]])
    select = torch.randint(-1, 40, (2, 2, 7))
    view = table.view(pool)
    paged = read(query, positions, view, 0.25, select=select)
    reference, _, _ = read_reference(query, positions, view.select(select), 0.25)
    assert torch.allclose(paged.out, reference, atol=1e-5)
