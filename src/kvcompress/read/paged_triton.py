"""The paged decode read in Triton (GPUs; tested on the CPU through Triton's interpreter, ``TRITON_INTERPRET=1``).

Same contract as ``paged.paged_decode`` (see its module docstring). The rows' slot tables (and log-weights)
are stacked into one int32 [R, H, L] table first (4 bytes per entry, against the 2·d·bytes of the entry it
names). A program reads one split of a (row, KV head)'s entries in blocks of ``Tuning.block``: it loads the slots,
then the keys and values they name straight from the pool, and keeps an online softmax for the head's GQA group in
float32 (flash-decoding); a second kernel merges the splits by log-sum-exp. Splits are sized so that the programs
fill the GPU (a few per multiprocessor) however few the rows; a launch shape (``Tuning``) that does not fit the
GPU (shared memory, registers) falls back to smaller ones, remembered per kernel variant. Entries of the KIVI tier
(``KIVI``: its tier, bits, block and channel group as constants) are unpacked and dequantised where they are loaded:
key = zero + code · scale per channel (the block's; its codes laid out channel by channel across the block's
entries), value the same per channel group (the entry's). Where a program's block of columns is one KIVI block long
and names that block's entries in order (holes allowed, nothing else), as the engine codes a head's oldest entries,
the block is read whole: its codes, zero points and scales as contiguous rows of bytes, the keys' logits taken on the
integer codes, (q ⊙ s)·c + q·z; other blocks of columns are read entry by entry (gathered bytes).

Precision: a float32 pool is read with float32 products throughout. A bfloat16 or float16 pool's products run on the
GPU's matrix units in TF32, which holds every 16-bit entry exactly: only the scaled query and the softmax weights are
rounded (to TF32's 10-bit mantissa); the accumulation, the softmax statistics and the sums stay float32. (Triton's
interpreter computes TF32 products in float32.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..store.slots import ENTRY_MASK, TIER_SHIFT
from ..store.view import KiviBlocks
from .tables import KIVI_FIELDS, stacked, stacked_log_weights


@triton.jit
def _dequantised(code, zero, scale, param, mask, dims, PARAM_ROW: tl.constexpr, CHANNELS_PER_PARAM: tl.constexpr):
    """zero + code · scale [BLOCK, DIM_PAD] (float32; 0 outside ``mask``): the zero points and scales of row ``param``
    (the block, or the entry) at channel // CHANNELS_PER_PARAM."""
    where = param[:, None] * PARAM_ROW + dims[None, :] // CHANNELS_PER_PARAM
    z = tl.load(zero + where, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale + where, mask=mask, other=0.0).to(tl.float32)
    return z + code.to(tl.float32) * s


@triton.jit
def _value_codes(codes, entry, mask, dims, DIM: tl.constexpr, BITS: tl.constexpr):
    """The codes [BLOCK, DIM_PAD] of coded values: an entry's codes in a row (``DIM · BITS / 8`` bytes)."""
    per: tl.constexpr = 8 // BITS
    packed = tl.load(codes + entry[:, None] * (DIM // per) + dims[None, :] // per, mask=mask, other=0).to(tl.int32)
    return (packed >> ((dims[None, :] % per) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _key_codes(codes, entry, block, mask, dims, DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """The codes [BLOCK, DIM_PAD] of coded keys: a block's key codes lie channel by channel across its GROUP
    entries (``GROUP · BITS / 8`` bytes a channel)."""
    per: tl.constexpr = 8 // BITS
    offset = entry % GROUP
    where = block[:, None] * (DIM * (GROUP // per)) + dims[None, :] * (GROUP // per) + (offset // per)[:, None]
    packed = tl.load(codes + where, mask=mask, other=0).to(tl.int32)
    return (packed >> ((offset % per)[:, None] * BITS).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _unpacked(packed, ROWS: tl.constexpr, BYTES: tl.constexpr, BITS: tl.constexpr):
    """Bytes [ROWS, BYTES] → codes [ROWS, BYTES · 8 / BITS] (int32), each byte's first code in its lowest bits (``pack``)."""
    per: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, per) * BITS
    codes = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (ROWS, BYTES * per))


@triton.jit
def _gathered(q, keys, values, slot, plain, entry, block, coded, key_codes, key_zero, key_scale, value_codes, value_zero, value_scale,
              dims, in_dim, DIM: tl.constexpr, KIVI_TIER: tl.constexpr, BITS: tl.constexpr, KIVI_GROUP: tl.constexpr,
              CHANNEL_GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """Logits [GROUPS_PAD, BLOCK] and values [BLOCK, DIM_PAD] (float32, 0 where not seen) of entries anywhere: plain
    ones' rows loaded from the pool, coded ones (where ``KIVI_TIER``) unpacked and dequantised element by element."""
    where = slot.to(tl.int64)[:, None] * DIM + dims[None, :]
    k = tl.load(keys + where, mask=plain[:, None] & in_dim[None, :], other=0.0).to(tl.float32)
    v = tl.load(values + where, mask=plain[:, None] & in_dim[None, :], other=0.0).to(tl.float32)
    if KIVI_TIER > 0:
        mask = coded[:, None] & in_dim[None, :]
        k += _dequantised(_key_codes(key_codes, entry, block, mask, dims, DIM, BITS, KIVI_GROUP), key_zero, key_scale, block, mask,
                          dims, DIM, 1)
        v += _dequantised(_value_codes(value_codes, entry, mask, dims, DIM, BITS), value_zero, value_scale, entry, mask, dims,
                          DIM // CHANNEL_GROUP, CHANNEL_GROUP)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION), v


@triton.jit
def _whole_block(q, block, key_codes, key_zero, key_scale, value_codes, value_zero, value_scale, dims, DIM: tl.constexpr,
                 BITS: tl.constexpr, KIVI_GROUP: tl.constexpr, CHANNEL_GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """Logits [GROUPS_PAD, KIVI_GROUP] and values [KIVI_GROUP, DIM] (float32) of one KIVI block's entries in order,
    its fields loaded whole (contiguous rows of bytes). The keys are never dequantised: with the block's zero points z
    and scales s per channel, q·k̂ = (q ⊙ s)·c + q·z, the integer codes c exact in any product precision."""
    per: tl.constexpr = 8 // BITS
    key_bytes: tl.constexpr = KIVI_GROUP // per  # a channel's codes across the block
    byte = tl.arange(0, key_bytes)
    packed = tl.load(key_codes + block * (DIM * key_bytes) + dims[:, None] * key_bytes + byte[None, :])  # [DIM, key_bytes]
    codes = _unpacked(packed, DIM, key_bytes, BITS).to(tl.float32)  # [DIM, KIVI_GROUP]: the keys' codes, transposed
    z = tl.load(key_zero + block * DIM + dims).to(tl.float32)
    s = tl.load(key_scale + block * DIM + dims).to(tl.float32)
    logits = tl.dot(q * s[None, :], codes, input_precision=PRECISION) + tl.sum(q * z[None, :], 1)[:, None]
    value_bytes: tl.constexpr = DIM // per
    value_groups: tl.constexpr = DIM // CHANNEL_GROUP
    offset = tl.arange(0, KIVI_GROUP)
    entry = block * KIVI_GROUP + offset
    packed = tl.load(value_codes + entry[:, None] * value_bytes + tl.arange(0, value_bytes)[None, :])  # [KIVI_GROUP, value_bytes]
    codes = tl.reshape(_unpacked(packed, KIVI_GROUP, value_bytes, BITS), (KIVI_GROUP, value_groups, CHANNEL_GROUP))
    where = entry[:, None] * value_groups + tl.arange(0, value_groups)[None, :]
    z = tl.load(value_zero + where).to(tl.float32)[:, :, None]
    s = tl.load(value_scale + where).to(tl.float32)[:, :, None]
    return logits, tl.reshape(z + codes.to(tl.float32) * s, (KIVI_GROUP, DIM))


@dataclass(frozen=True)
class Tuning:
    """Launch shape of the split kernel: entries per block, warps per program, software-pipelining stages, and the
    fewest entries a split may hold (``benchmarks/gpu_kernels.py`` sweeps these on a GPU)."""

    block: int = 64
    warps: int = 4
    stages: int = 2
    min_split: int = 256


# Measured on an H100 (runs/gpu_h100): block 128 read plain entries 1.24× faster in one case but overflowed shared
# memory in the engine at 32k entries; blocks of 32 without pipelining read KIVI-coded entries 2.0–2.5× faster.
TUNING = Tuning()
KIVI_TUNING = Tuning(block=32, stages=1)


def kivi_tuning(group_size: int) -> Tuning:
    """The launch shape for a read that may meet KIVI-coded entries: ``KIVI_TUNING``, its blocks one KIVI block long
    where that is 16 or 32 entries (a block of columns naming one KIVI block's entries is then read whole; the sizes
    compiled and checked on a GPU)."""
    return replace(KIVI_TUNING, block=group_size) if group_size in (16, 32) else KIVI_TUNING


PROGRAMS_PER_SM = 4  # splits per (row, head) are chosen so that the split kernel launches about this many per multiprocessor


@triton.jit
def _split_kernel(query, keys, values, slots, lengths, weights, key_codes, key_zero, key_scale, value_codes, value_zero, value_scale,
                  part_acc, part_max, part_sum, scores, scores_stride, scaling, table_row_stride, table_head_stride, splits,
                  split_len, num_slots, kivi_blocks, HAS_SCORES: tl.constexpr,
                  HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, PRECISION: tl.constexpr,
                  KIVI_TIER: tl.constexpr, BITS: tl.constexpr, KIVI_GROUP: tl.constexpr, CHANNEL_GROUP: tl.constexpr,
                  WHOLE_BLOCKS: tl.constexpr, TIER_SHIFT: tl.constexpr, ENTRY_MASK: tl.constexpr):
    row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths + row * HEADS + head)
    begin = split * split_len
    end = tl.minimum(length, begin + split_len)
    group = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, DIM_PAD)
    in_dim = dims < DIM
    query_rows = (row * HEADS + head) * GROUPS + group
    q = tl.load(query + query_rows[:, None] * DIM + dims[None, :], mask=(group < GROUPS)[:, None] & in_dim[None, :], other=0.0)
    q = q.to(tl.float32) * scaling
    top = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUPS_PAD], tl.float32)
    acc = tl.zeros([GROUPS_PAD, DIM_PAD], tl.float32)
    table = slots + row * table_row_stride + head * table_head_stride
    for start in range(begin, end, BLOCK):
        column = start + tl.arange(0, BLOCK)
        inside = column < end
        slot = tl.load(table + column, mask=inside, other=0)
        plain = inside & (slot != 0) & ((slot >> TIER_SHIFT) == 0) & (slot < num_slots)  # 0: padding or a hole
        entry = (slot & ENTRY_MASK).to(tl.int64)
        block = entry // KIVI_GROUP
        coded = inside & ((slot >> TIER_SHIFT) == KIVI_TIER) & (block > 0) & (block < kivi_blocks) & (KIVI_TIER > 0)
        seen = plain | coded
        if WHOLE_BLOCKS:  # the block's columns name one KIVI block's entries in order (holes allowed), and nothing else
            first = entry - (column - start)
            base = tl.max(tl.where(coded, first, -1), 0)
            whole = (base > 0) & (base % KIVI_GROUP == 0) & (tl.min(tl.where(coded, first, base), 0) == base)
            whole = whole & (tl.max(plain.to(tl.int32), 0) == 0)
            if whole:
                logits, v = _whole_block(q, base // KIVI_GROUP, key_codes, key_zero, key_scale, value_codes, value_zero, value_scale,
                                         dims, DIM, BITS, KIVI_GROUP, CHANNEL_GROUP, PRECISION)
            else:
                logits, v = _gathered(q, keys, values, slot, plain, entry, block, coded, key_codes, key_zero, key_scale, value_codes,
                                      value_zero, value_scale, dims, in_dim, DIM, KIVI_TIER, BITS, KIVI_GROUP, CHANNEL_GROUP, PRECISION)
        else:
            logits, v = _gathered(q, keys, values, slot, plain, entry, block, coded, key_codes, key_zero, key_scale, value_codes,
                                  value_zero, value_scale, dims, in_dim, DIM, KIVI_TIER, BITS, KIVI_GROUP, CHANNEL_GROUP, PRECISION)
        if HAS_WEIGHTS:
            logits += tl.load(weights + row * table_row_stride + head * table_head_stride + column, mask=inside, other=0.0)[None, :]
        logits = tl.where(seen[None, :], logits, float("-inf"))
        if HAS_SCORES:
            tl.store(scores + query_rows[:, None] * scores_stride + column[None, :], logits, mask=(group < GROUPS)[:, None] & inside[None, :])
        new_top = tl.maximum(top, tl.max(logits, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - shift)  # 0 while nothing was seen
        p = tl.exp(logits - shift[:, None])  # 0 on holes
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
        top = new_top
    part = (row * HEADS + head) * splits + split
    tl.store(part_acc + (part * GROUPS_PAD + group)[:, None] * DIM_PAD + dims[None, :], acc)
    tl.store(part_max + part * GROUPS_PAD + group, top)
    tl.store(part_sum + part * GROUPS_PAD + group, total)


@triton.jit
def _merge_kernel(part_acc, part_max, part_sum, out, lse, splits, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr):
    """One (row, KV head): its splits' unnormalised outputs and sums, rescaled to a running max, into the output
    (in its dtype) and the log-sum-exp (-inf, output 0, where nothing was seen)."""
    pair = tl.program_id(0)
    group = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, DIM_PAD)
    top = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUPS_PAD], tl.float32)
    acc = tl.zeros([GROUPS_PAD, DIM_PAD], tl.float32)
    for split in range(0, splits):
        part = pair * splits + split
        part_top = tl.load(part_max + part * GROUPS_PAD + group)
        new_top = tl.maximum(top, part_top)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        old, new = tl.exp(top - shift), tl.exp(part_top - shift)  # 0 for what saw nothing
        total = total * old + tl.load(part_sum + part * GROUPS_PAD + group) * new
        acc = acc * old[:, None] + tl.load(part_acc + (part * GROUPS_PAD + group)[:, None] * DIM_PAD + dims[None, :]) * new[:, None]
        top = new_top
    output = acc / tl.where(total > 0, total, 1.0)[:, None]
    rows = pair * GROUPS + group
    tl.store(out + rows[:, None] * DIM + dims[None, :], output.to(out.dtype.element_ty), mask=(group < GROUPS)[:, None] & (dims < DIM)[None, :])
    tl.store(lse + rows, tl.where(total > 0, top + tl.log(total), float("-inf")), mask=group < GROUPS)


def paged_decode_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor],
                        lengths: torch.Tensor, log_weights: list[torch.Tensor | None] | None, scaling: float,
                        kivi: KiviBlocks | None = None, scores: torch.Tensor | None = None, longest: int | None = None,
                        split: int | None = None, tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged.paged_decode``'s contract in Triton: (out [R, Hq, d] in the query's dtype, lse [R, Hq] float32).
    ``longest``: the longest head's length where the caller knows it (else read back from ``lengths``, which waits
    for the GPU); ``split``: entries per split (a multiple of ``tuning.block``), None to size splits to fill the GPU;
    ``tuning``: the split kernel's launch shape (None: ``TUNING``, or ``kivi_tuning``'s where coded entries may be read)."""
    rows, hq, dim = query.shape
    heads = lengths.shape[1]
    groups = hq // heads
    device = query.device
    if longest is None:
        longest = int(lengths.max()) if lengths.numel() else 0
    longest = max(1, longest)
    tuning = tuning or (TUNING if kivi is None else kivi_tuning(kivi.codec.block_size))
    slots = stacked(tables, longest, 0)
    weights = stacked_log_weights(tables, log_weights, longest)
    split = split or split_size(rows * heads, longest, multiprocessor_count(device), tuning)
    if split % tuning.block:
        raise ValueError(f"split={split} must be a multiple of the kernel's block ({tuning.block})")
    splits = triton.cdiv(longest, split)
    groups_pad, dim_pad = max(16, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(dim))
    part_acc = torch.empty(rows, heads, splits, groups_pad, dim_pad, dtype=torch.float32, device=device)
    part_max = torch.empty(rows, heads, splits, groups_pad, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    coded = [keys] * 6 if kivi is None else [kivi.arrays[name] for name in KIVI_FIELDS]
    arguments = (query.contiguous(), keys, values, slots, lengths.to(device=device, dtype=torch.int64).contiguous(),
                 slots if weights is None else weights, *coded, part_acc, part_max, part_sum, part_max if scores is None else scores,
                 0 if scores is None else scores.stride(1), scaling, slots.stride(0), slots.stride(1), splits, split, keys.shape[0],
                 coded[0].shape[0])
    constants = dict(HAS_SCORES=scores is not None, HEADS=heads, GROUPS=groups, GROUPS_PAD=groups_pad, DIM=dim, DIM_PAD=dim_pad,
                     HAS_WEIGHTS=weights is not None, PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
                     KIVI_TIER=0 if kivi is None else kivi.tier, BITS=2 if kivi is None else kivi.codec.bits,
                     KIVI_GROUP=1 if kivi is None else kivi.codec.block_size,
                     CHANNEL_GROUP=dim if kivi is None else kivi.codec.channel_group(dim), TIER_SHIFT=TIER_SHIFT, ENTRY_MASK=ENTRY_MASK)
    _launch_split((rows, heads, splits), arguments, constants, tuning, (str(device), keys.dtype, coded[0].dtype))
    out = torch.empty(rows, hq, dim, dtype=query.dtype, device=device)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=device)
    _merge_kernel[(rows * heads,)](part_acc, part_max, part_sum, out, lse, splits, GROUPS=groups, GROUPS_PAD=groups_pad, DIM=dim,
                                   DIM_PAD=dim_pad)
    return out, lse


_FITTING: dict[tuple, Tuning] = {}  # the launch shape that fitted the GPU, per kernel variant and shape asked for


def _launch_split(grid: tuple[int, int, int], arguments: tuple, constants: dict, tuning: Tuning, where: tuple) -> None:
    """Launch the split kernel in the shape asked for or, where that does not fit the GPU (shared memory, registers:
    ``OutOfResources`` at launch, before anything runs), the first smaller shape that does, remembered per variant."""
    key = (where, tuple(sorted(constants.items())), tuning)
    error = None
    for shape in [_FITTING[key]] if key in _FITTING else _smaller_shapes(tuning):
        whole_blocks = (constants["KIVI_TIER"] > 0 and shape.block == constants["KIVI_GROUP"] in (16, 32)
                        and constants["DIM"] == constants["DIM_PAD"])  # blocks of the sizes compiled and checked on a GPU
        try:
            _split_kernel[grid](*arguments, **constants, WHOLE_BLOCKS=whole_blocks, BLOCK=shape.block, num_warps=shape.warps,
                                num_stages=shape.stages)
        except OutOfResources as exceeded:
            error = exceeded
            continue
        _FITTING[key] = shape
        return
    raise error


def _smaller_shapes(tuning: Tuning):
    """The launch shape asked for, then without software pipelining, then with blocks halved down to 16 entries
    (a split of whole blocks stays one of halved blocks)."""
    yield tuning
    shape = replace(tuning, stages=1)
    while shape.block >= 16:
        if shape != tuning:
            yield shape
        shape = replace(shape, block=shape.block // 2)


def split_size(pairs: int, longest: int, multiprocessors: int | None, tuning: Tuning = TUNING) -> int:
    """Entries per split: few enough that ``pairs`` (row, head) pairs launch about ``PROGRAMS_PER_SM`` programs per
    multiprocessor, at least ``tuning.min_split`` (or the whole head, if shorter), a multiple of ``tuning.block``;
    one split per head where ``multiprocessors`` is None (Triton's interpreter)."""
    blocks = triton.cdiv(max(1, longest), tuning.block)
    if multiprocessors is None:
        return blocks * tuning.block
    wanted = triton.cdiv(PROGRAMS_PER_SM * multiprocessors, max(1, pairs))  # splits per pair
    return max(triton.cdiv(blocks, wanted), min(triton.cdiv(tuning.min_split, tuning.block), blocks)) * tuning.block


@functools.cache
def multiprocessor_count(device: torch.device) -> int | None:
    """The GPU's multiprocessor count; None off a GPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


__all__ = ["KIVI_TUNING", "TUNING", "Tuning", "kivi_tuning", "multiprocessor_count", "paged_decode_triton", "split_size"]
