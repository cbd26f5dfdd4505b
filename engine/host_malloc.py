"""The C allocator of a process that runs a model on the CPU: freed memory stays with the process.

A forward pass on the CPU allocates and frees tens of MB per layer (a 2048-token prefill of the
embedded model: a 25 MB gate/up product, 12 MB activations, and so on). Torch takes host memory
from the C library's malloc, and glibc's defaults hand large blocks back to the kernel as soon as
they are freed (blocks above a threshold that stops growing at 32 MB are mmap'ed of their own; a
free heap top above twice that threshold is trimmed), so the next layer's blocks are fresh pages
that fault in one 4 KiB page at a time. Measured on this project's 2-core VM (one process,
alternating settings, 2 threads): a 2048-token prefill step took 190-390 thousand page faults and
2.4-4.5 s with glibc's defaults, 17-35 thousand faults (the KV pages written for the first time)
and 1.9-2.1 s with freed memory kept. Decode steps allocate little and do not change. The
offline benchmark's workload (32 requests x 128 prompt tokens, 64 new tokens, 2 threads), three
pairs of processes alternating: 185-212 output tokens/s against 150-189 with glibc's defaults.
(The first rounds after the switch may still grow the heap: torch's aligned blocks do not fit
exactly the block freed before; freed neighbours merge and the growth stops.)

``keep_freed_memory`` sets glibc's ``M_MMAP_THRESHOLD`` (blocks up to 1 GiB come from the heap and
go back to it) and ``M_TRIM_THRESHOLD`` (the heap is never trimmed) with ``mallopt``, glibc's
public tuning call: what the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
variables do at start, done when an engine is built, since an offline user's process has started
long before. The process then keeps the peak of its host memory use, as torch's CUDA caching
allocator keeps device memory. Other C libraries (musl) and other systems are left as they are.
Set ``DUET_KEEP_FREED_MEMORY=0`` to leave glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# glibc's malloc.h parameter numbers (stable ABI since glibc 2.0).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks above this still get mappings of their own, given back when freed: nothing in a forward
# pass is that large, and a stray huge block should not stay in the heap for good.
MMAP_THRESHOLD = 1 << 30
# glibc takes an int; the largest one means "never trim".
TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache  # once per process (a second, racing call would only set the same values again)
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in this process; True where it now does."""
    if os.environ.get("DUET_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the symbols already loaded, glibc's among them
    # mallopt returns 1 on success, 0 on error.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
