"""CPU tensors on 2 MiB pages, for the arrays a decoding step streams: the model's weights and the KV slot pool.

A decoding step on the CPU reads every weight once and every held entry once, and is limited by the memory's read rate.
On 4 KiB pages each page of a streamed array costs a TLB miss (a page walk), and the CPU's hardware prefetch stops
at every 4 KiB boundary; on 2 MiB pages neither happens within a page. Linux backs an anonymous mapping with such
pages ("transparent huge pages") where it is advised to (``MADV_HUGEPAGE``; the kernel's default mode, ``madvise``,
gives them to no one else). PyTorch's own allocator advises them only where ``THP_MEM_ALLOC_ENABLE=1`` was set before
the process started, so the arrays here are mapped and advised here: the pool's by ``zeros``, the model's parameters
all in one mapping by ``move_parameters`` (a layer's weights are each under 2 MiB in a small model, but not together).

Measured on a 2-core AMD EPYC (Zen 5), the engine's float32 SnapKV step over 8 rows (``benchmarks/vs_vllm.py``'s run):
19.2–22.2 ms with both on 4 KiB pages, 16.7–18.2 with both on 2 MiB ones (docs/results.md).

Where the platform has no ``madvise`` (not Linux), or the kernel refuses the advice, or for a ``zeros`` array under
2 MiB, the tensor is PyTorch's own: the same numbers either way, only their pages differ.
"""

from __future__ import annotations

import math
import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page
ALIGN = 64  # bytes: a cache line, where each parameter starts in ``move_parameters``' mapping


def advises() -> bool:
    """Whether this system can advise a mapping for huge pages (Linux built with transparent huge pages); elsewhere every
    tensor here is PyTorch's own."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.path.isdir("/sys/kernel/mm/transparent_hugepage")


def zeros(*shape: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """``torch.zeros(*shape, dtype=dtype, device=device)``; on the CPU from 2 MiB-aligned anonymous memory advised for
    huge pages where the tensor takes at least one such page (the kernel zero-fills the pages as they are first touched)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not advises():
        return torch.zeros(*shape, dtype=dtype, device=device)
    mapped = _advised_mapping(nbytes)
    if mapped is None:
        return torch.zeros(*shape, dtype=dtype)
    region, start = mapped
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the last tensor over it is freed
    return whole[start : start + nbytes].view(dtype).view(shape)


def _advised_mapping(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """An anonymous mapping with room for ``nbytes`` from a 2 MiB boundary, advised for huge pages, and that boundary's
    offset in it; None where the kernel refuses the advice (built without transparent huge pages)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a page more, to align within
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        region.close()
        return None
    return region, -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE


@torch.no_grad()
def move_parameters(module: nn.Module) -> None:
    """Move the module's contiguous CPU parameters, in place (``parameter.data``), into one mapping advised for huge
    pages, one after another in the order the module lists them (a decoder's layer by layer: the order a decoding step
    streams them), each at a cache line's start: the same parameters, values and ties (a parameter two modules share is
    moved once), only their memory differs. Each parameter keeps a storage of its own, over its own bytes of the
    mapping, so nothing sees them as shared (``safetensors`` saves them as before). Moved one at a time, so the extra
    memory at any moment is one parameter's. A module already moved (its parameters where this would put them) is left
    as it is; where huge pages cannot be advised nothing moves.

    A layer's products of the 135M model in bfloat16 are 0.2-1.8 MB each: below one huge page, so on their own they
    stayed on 4 KiB pages. Together (Zen 5, the engine's SnapKV step over 8 rows, both ways in one process, alternated):
    9.81 → 9.03 ms a step in bfloat16, 15.22 → 14.81 in float32 (docs/results.md)."""
    parameters = [p for p in {id(p): p for p in module.parameters()}.values()
                  if p.device.type == "cpu" and p.is_contiguous() and p.numel() > 0]
    offsets, total = [], 0
    for parameter in parameters:
        offsets.append(total)
        total += -(-parameter.numel() * parameter.element_size() // ALIGN) * ALIGN
    if not parameters or not advises() or _lie_at(parameters, offsets):
        return
    mapped = _advised_mapping(total)
    if mapped is None:
        return
    region, start = mapped
    for parameter, offset in zip(parameters, offsets):  # each tensor holds the mapping until the last is freed
        moved = torch.frombuffer(region, dtype=parameter.dtype, count=parameter.numel(), offset=start + offset)
        parameter.data = moved.view(parameter.shape).copy_(parameter.data)


def _lie_at(parameters: list[torch.Tensor], offsets: list[int]) -> bool:
    """Whether the parameters already lie from a huge page's start at these offsets (moved before)."""
    first = parameters[0].data_ptr()
    return first % HUGE_PAGE == 0 and all(p.data_ptr() == first + offset for p, offset in zip(parameters, offsets))


__all__ = ["HUGE_PAGE", "advises", "move_parameters", "zeros"]
