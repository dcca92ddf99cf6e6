"""CPU tensors on 2 MiB pages, for the arrays a decoding step streams: the model's weights and the KV slot pool.

A decoding step on the CPU reads every weight once and every held entry once, and is limited by the memory's read rate.
On 4 KiB pages each page of a streamed array costs a TLB miss (a page walk), and the CPU's hardware prefetch stops
at every 4 KiB boundary; on 2 MiB pages neither happens within a page. Linux backs an anonymous mapping with such
pages ("transparent huge pages") where it is advised to (``MADV_HUGEPAGE``; the kernel's default mode, ``madvise``,
gives them to no one else). PyTorch's own allocator advises them only where ``THP_MEM_ALLOC_ENABLE=1`` was set before
the process started, so the arrays here are mapped and advised by ``zeros`` itself.

Measured on a 2-core AMD EPYC (Zen 5), the engine's float32 SnapKV step over 8 rows (``benchmarks/vs_vllm.py``'s run):
19.2–22.2 ms with both on 4 KiB pages, 16.7–18.2 with both on 2 MiB ones (docs/results.md).

Where the platform has no ``madvise`` (not Linux), or the kernel refuses the advice, or for an array under 2 MiB, the
tensor is PyTorch's own: the same numbers either way, only their pages differ.
"""

from __future__ import annotations

import math
import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page


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
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a page more, to align within
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return torch.zeros(*shape, dtype=dtype)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the last tensor over it is freed
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes].view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in ``zeros``' memory; the tensor itself where it is under 2 MiB, not on the CPU, or already
    starts on a 2 MiB boundary (moved here before, or PyTorch's own allocation under ``THP_MEM_ALLOC_ENABLE``: its
    allocator aligns other large blocks to 64 bytes only)."""
    if (tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < HUGE_PAGE
            or tensor.data_ptr() % HUGE_PAGE == 0):
        return tensor
    return zeros(*tensor.shape, dtype=tensor.dtype).copy_(tensor)


@torch.no_grad()
def move_parameters(module: nn.Module) -> None:
    """Move the module's CPU parameters of 2 MiB or more onto huge pages, in place (``parameter.data``): the same
    parameters, values and ties (a parameter two modules share is moved once), only their memory differs. Moved one
    at a time, so the extra memory at any moment is one parameter's."""
    for parameter in {id(p): p for p in module.parameters()}.values():
        if parameter.is_contiguous():
            parameter.data = on_huge_pages(parameter.data)


__all__ = ["HUGE_PAGE", "advises", "move_parameters", "on_huge_pages", "zeros"]
