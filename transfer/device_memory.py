"""Where mapped CUDA memory ends, asked of the driver: D checks that the pools P exports through
CUDA IPC lie inside the memory the handle actually mapped (ipc.py). A kernel reading past it would
fault, and a fault kills the decode worker's whole CUDA context, not one pull."""

from __future__ import annotations

import ctypes
import functools
from typing import Any


class DriverQueryFailed(RuntimeError):
    pass


@functools.cache
def _address_range() -> Any:
    try:
        query = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError) as e:
        raise DriverQueryFailed(
            f"cannot load the CUDA driver's cuMemGetAddressRange: {e}"
        ) from None
    query.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    query.restype = ctypes.c_int
    return query


def allocation_end(address: int) -> int:
    """The first address past the allocation (or mapping) that holds ``address``, in the current
    context. Raises DriverQueryFailed when the driver does not know the address."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _address_range()(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if status != 0:
        raise DriverQueryFailed(f"cuMemGetAddressRange failed ({status}) for {address:#x}")
    return base.value + size.value


def mapped_end(address: int, limit: int) -> int:
    """How far memory is mapped from ``address`` on, up to ``limit``: the end of its allocation,
    followed into the allocations that start right there. Memory of torch's expandable segments
    is one mapping per segment (20 MiB on an H200) laid end to end, and a pool spans many."""
    end = allocation_end(address)
    while end < limit:
        try:
            following = allocation_end(end)
        except DriverQueryFailed:  # nothing mapped there
            break
        if following <= end:
            break
        end = following
    return end
