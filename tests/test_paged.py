"""The in-place decoding read (read/paged.py): the compiled CPU kernel, the plain PyTorch path and the Triton kernel
(in Triton's interpreter) against the float32 reference read, over ragged heads, GQA groups, holes, log-weights,
storage dtypes and KIVI-coded entries (2 and 4 bits) mixed with plain ones; and the store's views handing their
entries over in place while they are plain or of one KIVI tier."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.read import decode_weights, read
from kvcompress.kernels import cpu_kernels
from kvcompress.read.paged import compiled_step, entry_weights, entry_weights_torch, paged_decode, paged_decode_torch
from kvcompress.read.pages import page_bounds_torch, top_pages, top_pages_torch
from kvcompress.read.reference import read_reference
from kvcompress.store.codecs import KiviCodec
from kvcompress.store.slots import TIER_SHIFT, SlotPool, SlotTable
from kvcompress.read.tables import select_pages, select_tables_torch
from kvcompress.store.view import Edit, KiviBlocks, KVView, Pages

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


def test_the_cpu_kernel_is_built():
    """The test machine compiles the kernel (make setup builds it): the tests below test it, not the fallback."""
    assert cpu_kernels() is not None


KIVI_TIER = 3


def _kivi_blocks(gen: torch.Generator, dim: int, bits: int, group_size: int, blocks: int, dtype: torch.dtype) -> KiviBlocks:
    """A tier of random KIVI blocks (block 0 unused, as in the pool), zero points and scales in the model dtype's 16-bit kind."""
    codec = KiviCodec(bits=bits, group_size=group_size, param_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)
    rows = codec.encode(torch.randn(blocks, group_size, dim, generator=gen) * 2, torch.randn(blocks, group_size, dim, generator=gen))
    return KiviBlocks(KIVI_TIER, codec, {name: torch.cat([torch.zeros_like(r[:1]), r]) for name, r in rows.items()})


CODED_LAYOUTS = ("anywhere", "blocks", "blocks-swapped")


def _case(seed: int, rows: int, heads: int, groups: int, dim: int, lengths: list[int], hole_rate: float, weighted: bool,
          dtype: torch.dtype, coded_rate: float = 0.0, bits: int = 2, group_size: int = 8, query_dtype: torch.dtype = torch.float32,
          coded_layout: str = "anywhere"):
    """A pool of random entries and per-row slot tables (strided views of (slot, position) pairs, with spare
    columns), some entries holes (slot 0) and some (``coded_rate``) entries of a KIVI tier; and the same entries
    laid out densely, decoded, for the reference. The query in ``query_dtype`` (the engine's: the pool's).
    ``coded_layout``: coded entries at random columns naming random entries ("anywhere"), or a head's first columns
    naming whole KIVI blocks' entries in order, as the engine codes them, each block anywhere in the tier ("blocks";
    "blocks-swapped": two of a block's columns swapped)."""
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
    index = pairs[:, :, :longest, 0].long()
    dense_keys, dense_values = keys[index].float(), values[index].float()
    kivi = None
    if coded_rate > 0 and coded_layout == "anywhere":
        kivi = _kivi_blocks(gen, dim, bits, group_size, 1 + total // group_size, dtype)
        coded = (torch.rand(rows, heads, longest, generator=gen) < coded_rate) & valid & ~holes
        entries = torch.randint(group_size, kivi.arrays["key_codes"].shape[0] * group_size, (int(coded.sum()),), generator=gen)
    elif coded_rate > 0:
        per_head = max(1, -(-longest // group_size))
        kivi = _kivi_blocks(gen, dim, bits, group_size, rows * heads * per_head, dtype)
        blocks = 1 + torch.randperm(rows * heads * per_head, generator=gen).view(rows, heads, per_head)
        ids = (blocks[..., None] * group_size + torch.arange(group_size)).flatten(2)[..., :longest]  # [R, H, L]
        if coded_layout == "blocks-swapped" and longest > 1:
            ids[..., [0, 1]] = ids[..., [1, 0]]
        whole = (lengths * coded_rate).long() // group_size * group_size  # coded columns per head: whole blocks
        coded = (span < whole[..., None]) & ~holes
        entries = ids[coded]
    if coded_rate > 0:
        pairs[:, :, :longest, 0][coded] = ((KIVI_TIER << TIER_SHIFT) | entries).int()
        dense_keys[coded], dense_values[coded] = kivi.codec.decode(kivi.arrays, entries)
    weights = torch.randn(rows, heads, longest + 5, 3, generator=gen) if weighted else None  # column 1: the log-weights
    query = torch.randn(rows, heads * groups, dim, generator=gen).to(query_dtype)
    capacity = [int(lengths[r].max()) + r for r in range(rows)]  # each row's table as wide as its own longest head (+ r)
    tables = [pairs[r, :, : capacity[r], 0] for r in range(rows)]
    log_weights = [weights[r, :, : capacity[r], 1] for r in range(rows)] if weighted else None
    bias = torch.zeros(rows, heads, longest) if weights is None else weights[:, :, :longest, 1]
    view = KVView.of(dense_keys, dense_values, torch.zeros(rows, heads, longest, dtype=torch.long), valid=valid,
                     log_weights=bias.masked_fill(holes, -math.inf))  # a hole: a weight of zero for the reference
    return query, keys, values, tables, lengths, log_weights, view, kivi


CASES = dict(rows=st.integers(1, 3), heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 4, 7]), dim=st.sampled_from([8, 64, 128]),
             data=st.data(), hole_rate=st.sampled_from([0.0, 0.3, 1.0]), weighted=st.booleans(),
             dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16),
             coded_rate=st.sampled_from([0.0, 0.5, 1.0]), bits=st.sampled_from([2, 4]), group_size=st.sampled_from([8, 16, 32]),
             coded_layout=st.sampled_from(CODED_LAYOUTS))


@settings(max_examples=40, deadline=None)
@given(**CASES)
def test_paged_decode_equals_the_reference_read(rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed, coded_rate, bits,
                                                group_size, coded_layout):
    """Ragged heads across the kernel's blocks (64) and chunks (512), holes anywhere, log-weights, GQA, KIVI-coded
    entries among plain ones: out and lse equal the float32 reference over the same (stored, decoded) entries; a head
    with nothing to read gives 0 and -inf."""
    _check_against_reference((paged_decode, paged_decode_torch), rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed,
                             coded_rate, bits, group_size, coded_layout)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group_size,dim", [(32, 64), (16, 128), (8, 64), (32, 80)])
@pytest.mark.parametrize("coded_layout", CODED_LAYOUTS)
def test_every_way_the_cpu_read_takes_kivi_values_equals_the_reference(bits, group_size, dim, coded_layout):
    """The CPU read multiplies coded values' codes as it unpacks them where a value group spans a multiple of 16
    channels (group sizes 16 and 32 over d = 64 or 128), decodes each value first where it does not (group size 8), and
    reads entry by entry where d is no multiple of 64 (80: one group of 80 channels); runs of a block's entries in order
    take their logits at once. Each equals the reference, with holes, log-weights and GQA groups of 3."""
    _check_against_reference((paged_decode,), 2, 2, 3, dim, None, 0.3, True, torch.float32, group_size + bits, 0.5, bits, group_size,
                             coded_layout, lengths=[1100, 65, 513, 64])


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_gqa_group_of_the_cpu_read_equals_the_reference(groups, dim, dtype):
    """The CPU read weighs plain values with every query of a group of up to four at once (its sums in registers), a
    larger group query by query: each equals the reference, over blocks and chunks, with holes and log-weights."""
    _check_against_reference((paged_decode,), 2, 2, groups, dim, None, 0.3, True, dtype, 7 * groups + dim, 0.0, 2, 8,
                             lengths=[1100, 65, 513, 64])


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU, 16-bit pools meet the matrix units in TF32: the scaled query and the softmax weights rounded to a 10-bit mantissa
TRITON_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3} if TRITON_DEVICE == "cuda" else TOLERANCE


@settings(max_examples=12 if TRITON_DEVICE == "cpu" else 25, deadline=None)
@given(**CASES, split=st.sampled_from([None, 128, 256, 512]))
def test_the_triton_read_equals_the_reference_read(rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed, coded_rate, bits,
                                                   group_size, coded_layout, split):
    """The GPU kernel, on a GPU where there is one, else in Triton's interpreter on the CPU (the suite sets
    TRITON_INTERPRET=1 without a GPU); splits of any size, merged."""
    triton_read = functools.partial(pytest.importorskip("kvcompress.read.paged_triton").paged_decode_triton, split=split)
    triton_read.__name__ = f"paged_decode_triton(split={split})"
    _check_against_reference((triton_read,), rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed, coded_rate, bits, group_size,
                             coded_layout, device=TRITON_DEVICE, tolerance=TRITON_TOLERANCE[dtype], longer=split is not None)


@settings(max_examples=6 if TRITON_DEVICE == "cpu" else 15, deadline=None)
@given(bits=st.sampled_from([2, 4]), group_size=st.sampled_from([16, 32]), layout=st.sampled_from(CODED_LAYOUTS[1:]),
       hole_rate=st.sampled_from([0.0, 0.3]), weighted=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       groups=st.sampled_from([1, 4]), dim=st.sampled_from([64, 128]), seed=st.integers(0, 2**16), data=st.data())
def test_the_triton_read_of_whole_kivi_blocks_equals_the_reference_read(bits, group_size, layout, hole_rate, weighted, dtype, groups, dim,
                                                                         seed, data):
    """Heads whose first columns name whole KIVI blocks' entries in order, as the engine codes them: the kernel reads
    each such block whole (its codes as rows of bytes, the keys' product on the codes); a block with two columns
    swapped is read entry by entry. Both equal the reference."""
    triton_read = pytest.importorskip("kvcompress.read.paged_triton").paged_decode_triton
    _check_against_reference((triton_read,), 2, 2, groups, dim, data, hole_rate, weighted, dtype, seed, 0.9, bits, group_size, layout,
                             device=TRITON_DEVICE, tolerance=TRITON_TOLERANCE[dtype])


def test_a_launch_shape_that_does_not_fit_the_gpu_falls_back_to_smaller_ones(monkeypatch):
    """A GPU that holds only blocks of 16 entries without pipelining: the read tries the shape asked for, then smaller
    ones, reads correctly in the one that fits and remembers it; where none fits, the GPU's error."""
    paged_triton = pytest.importorskip("kvcompress.read.paged_triton")
    from triton.runtime.errors import OutOfResources

    real, tried = paged_triton._split_kernel, []

    class SmallGpu:
        def __init__(self, fits):
            self.fits = fits

        def __getitem__(self, grid):
            def launch(*arguments, BLOCK, num_warps, num_stages, **constants):
                tried.append((BLOCK, num_stages))
                if not self.fits(BLOCK, num_stages):
                    raise OutOfResources(300_000, 232_448, "shared memory")
                real[grid](*arguments, BLOCK=BLOCK, num_warps=num_warps, num_stages=num_stages, **constants)
            return launch

    query, keys, values, tables, lengths, log_weights, _, _ = _case(5, 2, 2, 2, 64, [70, 5, 130, 64], 0.3, True, torch.float32)
    query, keys, values = query.to(TRITON_DEVICE), keys.to(TRITON_DEVICE), values.to(TRITON_DEVICE)
    tables, log_weights = [t.to(TRITON_DEVICE) for t in tables], [w.to(TRITON_DEVICE) for w in log_weights]
    read = functools.partial(paged_triton.paged_decode_triton, query, keys, values, tables, lengths, log_weights, 0.125, split=128)
    expected = read()
    monkeypatch.setattr(paged_triton, "_FITTING", {})
    monkeypatch.setattr(paged_triton, "_split_kernel", SmallGpu(lambda block, stages: block <= 16 and stages == 1))
    for attempts in ([(64, 2), (64, 1), (32, 1), (16, 1)], [(16, 1)]):  # the second read goes straight to what fitted
        tried.clear()
        out = read()
        assert tried == attempts
        for got, want in zip(out, expected):
            torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(paged_triton, "_FITTING", {})
    monkeypatch.setattr(paged_triton, "_split_kernel", SmallGpu(lambda block, stages: False))
    with pytest.raises(OutOfResources):
        read()


@settings(max_examples=200, deadline=None)
@given(pairs=st.integers(1, 4096), longest=st.integers(0, 200_000), sms=st.sampled_from([None, 1, 16, 132]), kivi=st.booleans())
def test_splits_cover_each_head_in_blocks_and_fill_the_gpu_without_flooding_it(pairs, longest, sms, kivi):
    """A split is whole blocks, at least the smallest split (or the whole head), and the splits cover the head; one
    split per head off a GPU; on one, no more programs than about PROGRAMS_PER_SM per multiprocessor."""
    paged_triton = pytest.importorskip("kvcompress.read.paged_triton")
    tuning = paged_triton.KIVI_TUNING if kivi else paged_triton.TUNING
    split = paged_triton.split_size(pairs, longest, sms, tuning)
    whole = -(-max(1, longest) // tuning.block) * tuning.block
    assert split % tuning.block == 0 and split >= min(tuning.min_split, whole) and split * -(-longest // split) >= longest
    splits = -(-max(1, longest) // split)
    if sms is None:
        assert splits == 1
    else:
        assert pairs * splits < paged_triton.PROGRAMS_PER_SM * sms + pairs


def _check_against_reference(reads, rows, heads, groups, dim, data, hole_rate, weighted, dtype, seed, coded_rate, bits, group_size,
                             coded_layout="anywhere", device="cpu", tolerance=None, longer=False, lengths=None):
    """``longer``: also read with the longest head given as longer than it is (more, empty splits), which must
    change nothing. ``data`` None: ``lengths`` given and a float32 query."""
    tolerance = tolerance or TOLERANCE[dtype]
    if data is not None:
        lengths = data.draw(st.lists(st.sampled_from([0, 1, 5, 63, 64, 65, 511, 513, 1100]), min_size=rows * heads, max_size=rows * heads))
    query_dtype = data.draw(st.sampled_from([torch.float32, dtype])) if data is not None else torch.float32  # the engine's: the pool's
    query, keys, values, tables, lengths, log_weights, view, kivi = _case(seed, rows, heads, groups, dim, lengths, hole_rate, weighted,
                                                                          dtype, coded_rate, bits, group_size, query_dtype, coded_layout)
    rounding = torch.finfo(query_dtype).eps if query_dtype != torch.float32 else 0.0  # the output comes back in the query's dtype
    scaling = 1 / math.sqrt(dim)
    ref_out, ref_lse, ref_sums = read_reference(query[:, :, None], torch.ones(rows, 1, dtype=torch.long), view, scaling, col_sums=True)
    longest = view.shape[2]
    on = lambda tensors: None if tensors is None else [t.to(device) for t in tensors]  # noqa: E731
    query, keys, values, tables, log_weights = query.to(device), keys.to(device), values.to(device), on(tables), on(log_weights)
    if kivi is not None:
        kivi = KiviBlocks(kivi.tier, kivi.codec, {name: array.to(device) for name, array in kivi.arrays.items()})
    for fn in reads:
        out, lse = (t.cpu() for t in fn(query, keys, values, tables, lengths, log_weights, scaling, kivi))
        assert out.shape == query.shape and lse.shape == query.shape[:2] and lse.dtype == torch.float32
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse[:, :, 0])), fn.__name__
        finite = torch.isfinite(lse)
        assert torch.allclose(lse[finite], ref_lse[:, :, 0][finite], atol=tolerance, rtol=tolerance), fn.__name__
        assert out.dtype == query_dtype
        assert torch.allclose(out.float(), ref_out[:, :, 0], atol=tolerance * 10, rtol=tolerance + rounding), fn.__name__
        assert bool((out[~finite] == 0).all())
        if longer:
            out_longer, lse_longer = (t.cpu() for t in fn(query, keys, values, tables, lengths, log_weights, scaling, kivi, None,
                                                          int(lengths.max()) + 700))
            assert torch.equal(out_longer, out) and torch.equal(lse_longer, lse), fn.__name__
        # asked for, the logits are written in place (3 spare columns stay as they were); the read is unchanged
        scores = torch.full((rows, heads * groups, longest + 3), -math.inf, device=device)
        out_again, lse_again = (t.cpu() for t in fn(query, keys, values, tables, lengths, log_weights, scaling, kivi, scores))
        assert torch.equal(out_again, out) and torch.equal(lse_again, lse), fn.__name__
        scores = scores.cpu()
        sums = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]).view(rows, heads, groups, -1).mean(2)
        assert torch.allclose(sums[..., :longest], ref_sums, atol=tolerance, rtol=tolerance), fn.__name__
        assert bool((sums[..., longest:] == 0).all()), fn.__name__


@pytest.mark.parametrize("read_fn", [paged_decode, paged_decode_torch])
def test_a_slot_outside_the_pool_or_a_tier_not_given_is_refused(read_fn):
    query, keys, values, tables, lengths, _, _, kivi = _case(0, 1, 1, 1, 8, [10], 0.0, False, torch.float32, coded_rate=0.5)
    for bad in (keys.shape[0] + 5, (KIVI_TIER + 1) << TIER_SHIFT | 9, KIVI_TIER << TIER_SHIFT | 1):  # past the pool; other tier; block 0
        wrong = [t.clone() for t in tables]
        wrong[0][0, 3] = bad
        with pytest.raises(RuntimeError, match="outside the pool"):
            read_fn(query, keys, values, wrong, lengths, None, 1.0, kivi)
    with pytest.raises(RuntimeError, match="outside the pool"):  # coded entries, no tier given
        read_fn(query, keys, values, tables, lengths, None, 1.0)


def test_a_view_reads_in_place_while_its_entries_are_plain_or_of_one_kivi_tier():
    """A table's view carries pages (no copy of the entries: the table itself), also once entries are KIVI-coded (the
    kernel dequantises them); rows naming two coded tiers read by gathering. Every read agrees with the reference."""
    torch.manual_seed(0)
    pool, table = SlotPool(16), SlotTable(2, 2)
    table.append(pool, torch.randn(2, 2, 80, 16), torch.randn(2, 2, 80, 16), torch.arange(80).expand(2, 80))
    query, positions = torch.randn(2, 4, 1, 16), torch.tensor([[80], [80]])

    def agrees(view) -> None:
        paged = read(query[: view.shape[0]], positions[: view.shape[0]], view, 0.25)
        reference, lse, sums = read_reference(query[: view.shape[0]], positions[: view.shape[0]], view, 0.25, col_sums=True)
        assert torch.allclose(paged.out, reference, atol=1e-5)
        assert paged.lse is None or torch.allclose(paged.lse, lse, atol=1e-5)  # the exact SDPA path gives none
        with_sums = read(query[: view.shape[0]], positions[: view.shape[0]], view, 0.25, col_sums=True)  # in place too (H2O's)
        assert torch.allclose(with_sums.out, reference, atol=1e-5) and torch.allclose(with_sums.col_sums, sums, atol=1e-5)

    view = table.view(pool)
    assert view.pages is not None and view.pages.tables[0].data_ptr() == table.ids.data_ptr()
    agrees(view)
    table.code(pool, pool.tier(KiviCodec(bits=4, group_size=32)), recent=16, rows=slice(0, 1))
    coded = table.view(pool)
    assert coded.pages is not None and coded.pages.arrays()[2].tier == 1 and coded.pages.tables[0].data_ptr() == table.ids.data_ptr()
    agrees(coded)
    table.code(pool, pool.tier(KiviCodec(bits=2, group_size=32)), recent=16, rows=slice(1, 2))
    assert table.view(pool).pages is None  # two tiers in one read: gathered and decoded
    agrees(table.view(pool))
    first = table.view(pool, slice(0, 1))
    assert first.pages is not None and first.pages.arrays()[2].tier == 1
    agrees(first)


@pytest.mark.skipif(cpu_kernels() is None, reason="the compiled CPU kernels are not built")
@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 3), rows=st.integers(1, 3), heads=st.integers(1, 2), groups=st.sampled_from([1, 3]), data=st.data(),
       weighted=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), coded_rate=st.sampled_from([0.0, 0.5]),
       seed=st.integers(0, 2**16))
def test_a_step_reads_each_layer_as_paged_decode_reads_its_tables(layers, rows, heads, groups, data, weighted, dtype, coded_rate, seed):
    """A decoding step's reads laid out once (``PagedStep``: per row the tables of every layer [L, H, C], strided views of
    (slot, position) pairs, the lengths [L, R, H]): each layer's read is paged_decode's over that layer's tables, bit for
    bit, plain and KIVI-coded entries, with and without log-weights."""
    lengths = data.draw(st.lists(st.sampled_from([0, 1, 5, 64, 65, 300]), min_size=layers * rows * heads, max_size=layers * rows * heads))
    query, keys, values, tables, length, log_weights, _, kivi = _case(seed, layers * rows, heads, groups, 16, lengths, 0.3, weighted,
                                                                      dtype, coded_rate, group_size=16)
    width = max(t.shape[1] for t in tables)
    pairs = torch.zeros(rows, layers, heads, width + 2, 2, dtype=torch.int32)  # each row's tables of every layer, side by side
    weights = torch.zeros(rows, layers, heads, width + 2)
    for index, table in enumerate(tables):
        pairs[index % rows, index // rows, :, : table.shape[1], 0] = table
        if weighted:
            weights[index % rows, index // rows, :, : table.shape[1]] = log_weights[index]
    step_tables = [pairs[r, ..., 0] for r in range(rows)]
    step_weights = [weights[r] if weighted else None for r in range(rows)]
    slots = torch.arange(layers * rows * heads).view(layers, rows, heads)
    step = compiled_step(Pages(lambda: (keys, values, kivi), step_tables, length.view(layers, rows, heads), step_weights), slots, 16)
    assert step.layers == layers
    for layer in range(layers):
        part = slice(layer * rows, (layer + 1) * rows)
        expected, _ = paged_decode(query[part], keys, values, tables[part], length[part], log_weights[part] if weighted else None, 0.25, kivi)
        assert torch.equal(step.read(query[part], 0.25, layer), expected)


@pytest.mark.skipif(cpu_kernels() is None, reason="the compiled CPU kernels are not built")
def test_a_step_refuses_tables_that_do_not_fit_before_any_read():
    keys = values = torch.zeros(8, 16)
    tables, lengths, none = [torch.zeros(2, 1, 4, dtype=torch.int32)], torch.full((2, 1, 1), 4), [torch.empty(0)]
    make = cpu_kernels().PagedStep
    make(keys, values, torch.ones(2, 1, 1, dtype=torch.long), tables, lengths, none, TIER_SHIFT, [], [])
    with pytest.raises(RuntimeError, match="longer than its slot table"):
        make(keys, values, torch.ones(2, 1, 1, dtype=torch.long), tables, lengths + 1, none, TIER_SHIFT, [], [])
    with pytest.raises(RuntimeError, match=r"\[layers, H, L\]"):
        make(keys, values, torch.ones(2, 1, 1, dtype=torch.long), [tables[0][:1]], lengths, none, TIER_SHIFT, [], [])
    with pytest.raises(RuntimeError, match="slots"):
        make(keys, values, torch.ones(2, 2, 1, dtype=torch.long), tables, lengths, none, TIER_SHIFT, [], [])
    with pytest.raises(RuntimeError, match="no such layer"):
        make(keys, values, torch.ones(2, 1, 1, dtype=torch.long), tables, lengths, none, TIER_SHIFT, [], []).read(torch.zeros(1, 1, 16), 1.0, 2)


def test_a_step_finds_every_layer_of_its_tables_in_place_while_one_reader_covers_them():
    """``SlotTable.step_pages``: the tables' own arrays (no copy) and lengths [L, R, H], plain or of one KIVI tier; None once
    the rows name two tiers no one read covers."""
    torch.manual_seed(2)
    pool, tables = SlotPool(16), [SlotTable(2, 2), SlotTable(2, 2)]
    for table, n in zip(tables, (80, 50)):
        table.append(pool, torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16), torch.arange(n).expand(2, n))
    pages = SlotTable.step_pages(pool, tables)
    assert [t.data_ptr() for t in pages.tables] == [t.ids.data_ptr() for t in tables] and pages.arrays()[2] is None
    assert torch.equal(pages.lengths, torch.stack([t.lengths for t in tables], 1)) and pages.log_weights == [None, None]
    tables[0].code(pool, pool.tier(KiviCodec(bits=4, group_size=32)), recent=16, rows=slice(0, 2))
    assert SlotTable.step_pages(pool, tables).arrays()[2].tier == 1
    tables[1].code(pool, pool.tier(KiviCodec(bits=2, group_size=16)), recent=16, rows=slice(1, 2))
    assert SlotTable.step_pages(pool, tables) is None


def test_a_selection_reads_only_the_chosen_entries_in_place():
    """Dynamic selection (Quest, OmniKV) on pages: the chosen entries, holes (-1) skipped, as the reference reads them."""
    torch.manual_seed(1)
    pool, table = SlotPool(16), SlotTable(2, 2)
    table.append(pool, torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16), torch.arange(40).expand(2, 40))
    query, positions = torch.randn(2, 2, 1, 16), torch.tensor([[40], [40]])
    select = torch.randint(-1, 40, (2, 2, 7))
    view = table.view(pool)
    paged = read(query, positions, view, 0.25, select=select, col_sums=True)
    reference, _, sums = read_reference(query, positions, view.select(select), 0.25, col_sums=True)
    assert torch.allclose(paged.out, reference, atol=1e-5)
    chosen = torch.zeros(2, 2, 40).scatter_add(-1, select.clamp(min=0), sums.masked_fill(select < 0, 0.0))  # back in the view's columns
    assert torch.allclose(paged.col_sums, chosen, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), width=st.integers(1, 40), k=st.integers(0, 30),
       weighted=st.lists(st.booleans(), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_the_compiled_selection_of_the_tables_equals_the_reference(rows, heads, width, k, weighted, seed):
    """``select_pages``: each head's chosen columns of its row's slot table and log-weights (holes: slot 0, weight 0)
    and its length up to its last chosen column, compiled as ``select_tables_torch`` gives them, from tables that are
    strided views of the store's, rows with and without log-weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (rows, heads, width + 3, 2), generator=gen, dtype=torch.int32)
    store_weights = torch.randn(rows, heads, width + 3, 2, generator=gen)
    tables = [ids[r, :, :, 0] for r in range(rows)]  # [H, width + 3], entry stride 2
    log_weights = [store_weights[r, :, :, 1] if weighted[r] else None for r in range(rows)]
    columns = torch.randint(-1, width, (rows, heads, k), generator=gen)
    pages = Pages(lambda: None, tables, torch.full((rows, heads), width), log_weights)
    selected = select_pages(pages, columns)
    want_tables, want_lengths, want_weights = select_tables_torch(tables, log_weights, columns)
    assert torch.equal(selected.lengths, want_lengths)
    for got, want in zip(selected.tables, want_tables):
        assert got.dtype == torch.int32 and torch.equal(got, want)
    for got, want, weight in zip(selected.log_weights, want_weights, log_weights):
        assert (got is None) == (weight is None) and (got is None or torch.equal(got, want))
    if k:  # the reference itself: the chosen slot, 0 on a hole; each head up to its last chosen column
        slot = torch.where(columns[0] < 0, 0, ids[0, :, :, 0].gather(-1, columns[0].clamp(min=0)))
        assert torch.equal(want_tables[0], slot.int())
        last = [max([j + 1 for j in range(k) if columns[0, h, j] >= 0], default=0) for h in range(heads)]
        assert want_lengths[0].tolist() == last
    with pytest.raises(RuntimeError, match="a column of its table"):
        select_pages(pages, torch.full((rows, heads, 1), width + 3))


def test_decode_weights_in_place_equal_the_references():
    """Each entry's weight for one decoding query (OmniKV's choice): from the in-place read's logits, as the float32
    reference gives them, over ragged heads with log-weights; 0 on padding, each query head's weights summing to 1."""
    torch.manual_seed(2)
    pool, table = SlotPool(16), SlotTable(2, 2)
    table.append(pool, torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16), torch.arange(30).expand(2, 30))
    table.retain(pool, torch.rand(2, 2, 30) < 0.7)  # ragged heads
    table.apply(pool, Edit(log_weights=torch.randn(2, 2, 30).clamp(max=0)))
    query, positions = torch.randn(2, 6, 1, 16), torch.tensor([[30], [30]])
    view = table.view(pool)
    assert view.pages is not None and view.log_weights is not None and view.valid is not None
    in_place = decode_weights(query, positions, view, 0.25)
    plain = KVView(view.positions, view.lengths, keys=view.keys, values=view.values, log_weights=view.log_weights)
    assert plain.pages is None
    reference = decode_weights(query, positions, plain, 0.25)
    assert in_place.shape == reference.shape == (2, 2, 3, view.shape[2])
    torch.testing.assert_close(in_place, reference, atol=1e-6, rtol=1e-5)
    assert bool((in_place.masked_fill(view.valid[:, :, None], 0.0) == 0).all())
    torch.testing.assert_close(in_place.sum(-1), torch.ones(2, 2, 3))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3), total=st.integers(0, 12), page_size=st.integers(1, 5),
       spare=st.integers(0, 3), d=st.sampled_from([1, 4, 13, 64]), levels=st.integers(1, 4), width=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data(), seed=st.integers(0, 2**16))
def test_the_compiled_top_pages_equal_the_reference(rows, heads, group, total, page_size, spare, d, levels, width, dtype, data, seed):
    """Quest's choice of pages, compiled from the query and the store's page bounds, column for column as the PyTorch
    reference (``top_pages_torch`` over ``page_bounds_torch``): integer-valued queries and keys, so that every bound's
    sum is exact in either order and few levels make ties (the earlier page first); bounds as the store holds them (a
    view of the first pages of a longer array, in the keys' dtype); pages not worth a bound, heads that may take none
    to all, columns not open, protected ones."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randint(-levels, levels + 1, (rows, heads, group, d), generator=gen).float()
    held = torch.randint(-levels, levels + 1, (rows, heads, total + spare, 2, d), generator=gen).sort(dim=3).values.to(dtype)
    bounds = held[:, :, :total]  # min ≤ max
    useful = torch.rand(rows, heads, total, generator=gen) < 0.8
    count = torch.randint(0, total + 2, (rows, heads), generator=gen)
    pages = data.draw(st.integers(0, total))
    protected = torch.randint(-1, max(1, total * page_size), (rows, heads, width), generator=gen)
    open_columns = torch.rand(rows, heads, total * page_size, generator=gen) < 0.85
    args = (useful, count, protected, open_columns, page_size, pages)
    expected = top_pages_torch(page_bounds_torch(query, bounds), *args)
    assert expected.shape == (rows, heads, width + pages * page_size)
    assert torch.equal(cpu_kernels().top_pages(query, bounds, *args), expected)
    assert torch.equal(top_pages(query, bounds, *args), expected)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), group=st.integers(1, 4), length=st.integers(0, 40),
       mean=st.booleans(), seed=st.integers(0, 2**16))
def test_the_compiled_entry_weights_equal_the_reference(rows, heads, group, length, mean, seed):
    """A decoding read's logits made weights (or their mean over the group: column sums) in one compiled pass, as
    ``entry_weights_torch`` makes them: holes and columns past a head's length (-inf) weigh 0, and so does every entry
    of a query head that read nothing (lse -inf); logits far below the lse (underflow) too."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, heads * group, length, generator=gen) * 30
    logits = logits.masked_fill(torch.rand(rows, heads * group, length, generator=gen) < 0.2, float("-inf"))
    logits[:, :1] = float("-inf")  # a query head that read nothing
    lse = torch.logsumexp(logits, dim=-1)
    expected = entry_weights_torch(logits.clone(), lse, group, mean)
    scores = logits.clone()
    weights = entry_weights(scores, lse, group, mean)
    assert weights.shape == ((rows, heads, length) if mean else (rows, heads * group, length))
    torch.testing.assert_close(weights, expected, atol=1e-7, rtol=1e-6)
    if not mean:
        assert weights.data_ptr() == scores.data_ptr()  # in place, as the reference
        assert bool((weights[:, 0] == 0).all())  # the query head that read nothing


def test_a_read_hands_out_its_weights_in_the_views_columns():
    """``read(weights=True)``: each entry's weight from the read itself, in the view's columns, as the reference gives
    them: over every entry in place, over a selection (0 on the columns left out) and without pages."""
    torch.manual_seed(3)
    pool, table = SlotPool(16), SlotTable(2, 2)
    table.append(pool, torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16), torch.arange(24).expand(2, 24))
    query, positions = torch.randn(2, 4, 1, 16), torch.tensor([[24], [24]])
    view = table.view(pool)
    plain = KVView(view.positions, view.lengths, keys=view.keys, values=view.values)
    expected = decode_weights(query, positions, plain, 0.25)  # [2, 2, 2, 24]
    for source in (view, plain):
        result = read(query, positions, source, 0.25, weights=True)
        torch.testing.assert_close(result.weights, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.out, read(query, positions, plain, 0.25, reference=True).out, atol=1e-5, rtol=1e-5)
    select = torch.stack([torch.randperm(24)[:9] for _ in range(4)]).view(2, 2, 9)
    chosen = read(query, positions, view, 0.25, select=select, weights=True).weights
    alone = decode_weights(query, positions, plain.select(select), 0.25)  # [2, 2, 2, 9]: the chosen entries' weights
    torch.testing.assert_close(chosen.gather(-1, select[:, :, None].expand_as(alone)), alone, atol=1e-6, rtol=1e-5)
    left_out = torch.ones(2, 2, 24, dtype=torch.bool).scatter(-1, select, False)
    assert bool((chosen.masked_fill(~left_out[:, :, None], 0.0) == 0).all())
    with pytest.raises(ValueError, match="one decoding query"):
        read(torch.randn(2, 4, 2, 16), torch.tensor([[24, 25], [24, 25]]), view, 0.25, weights=True)
