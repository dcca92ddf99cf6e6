"""A forward's short-lived CPU buffers kept on the heap once freed, not returned to the system and faulted in again.

Each product, norm and activation of a prefill chunk writes a fresh tensor of a few to a few tens of MB (a 2048-token
chunk's gate and up outputs are 25 MB in float32), freed a moment later. glibc's ``malloc`` serves a block that large
with its own ``mmap`` and unmaps it when freed, unless its dynamic threshold has risen past the block's size; so the next
chunk's tensor of the same size comes back as new pages, and each 4 KiB page is faulted in and zero-filled by the kernel
before the product writes it. ``keep_freed_buffers`` sets glibc's thresholds once for the process: blocks up to
``MMAP_THRESHOLD`` come from the heap, and the heap's top is not trimmed back below ``TRIM_THRESHOLD``. The process
then holds, once freed, about the largest set of such buffers a step had alive at once (tens of MB at 2048 tokens a
step), where it would have given them back and asked again.

Measured on a 2-core AMD EPYC (Zen 5), float32 SmolLM2, 8 prompts of 2000 tokens prefilled 2048 tokens a step, seven
processes each way, alternated: 80-810 thousand page faults and 0.1-1.2 s of system time a prefill with glibc's defaults
(one process of seven settled at ~1 thousand), at most 18 thousand and 0.05 s with these thresholds; 1399-1482 (mean
1437) against 1458-1544 (mean 1490) prompt tokens/s (docs/results.md).

Elsewhere (not glibc: musl, macOS, Windows) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # bytes: the largest glibc takes (its DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before glibc trims it
TOP_PAD = 64 << 20  # bytes the heap grows by at least, each time it grows

_kept = False


def keep_freed_buffers() -> bool:
    """Set glibc's ``malloc`` thresholds (above) once for this process; True where they are set (now or before), False
    where the C library is not glibc or refused one of them."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    _kept = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    return _kept


__all__ = ["keep_freed_buffers"]
