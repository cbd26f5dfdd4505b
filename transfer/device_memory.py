"""Where a CUDA allocation ends, asked of the driver: D checks that the pools P exports through
CUDA IPC lie inside the memory the handle actually mapped (ipc.py). A kernel reading past it would
fault, and a fault kills the decode worker's whole CUDA context, not one pull."""

from __future__ import annotations

import ctypes
import functools


class DriverQueryFailed(RuntimeError):
    pass


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DriverQueryFailed(f"cannot load the CUDA driver: {e}") from None


def allocation_end(address: int) -> int:
    """The first address past the allocation that holds ``address`` (in the current context).
    Raises DriverQueryFailed when the driver does not know the address."""
    query = _driver().cuMemGetAddressRange_v2
    query.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    query.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = query(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if status != 0:
        raise DriverQueryFailed(f"cuMemGetAddressRange failed ({status}) for {address:#x}")
    return base.value + size.value
