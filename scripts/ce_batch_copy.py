"""Page-to-page copies on the copy engines, for scripts/bench_page_copy.py: one
``cudaMemcpyBatchAsync`` call (CUDA 13 runtime) for every run of pages of a request.

Measured as an alternative to the SM copy kernel of the direct path (kernels.copy_pages), since copy
engines take no SMs from the model: on 2 H200s a batch of scattered 256 KiB pages ran at 0.36-0.54
of a peer copy (a per-copy cost in the engines), while the kernel's device time matches a peer
copy's (scripts/probe_read_path.py), so the transceiver does not use it (docs/benchmarks/
transfer.md). Contiguous runs reach 0.93-0.95 at >= 256 MiB.

The binding goes through ctypes to the CUDA runtime torch already loaded, so it needs no compiler;
``available()`` says whether this runtime has the call.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

from transfer.mapper import page_runs

_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice (a hint only; ignored for non-managed memory)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime this process's torch uses (found in the process's mappings, so it is the
    very library torch loaded), or None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = None
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            for line in f:
                name = line.rstrip().rsplit(" ", 1)[-1]
                if "/libcudart.so" in name:
                    path = name
                    break
    except OSError:
        pass
    try:
        lib = ctypes.CDLL(path or "libcudart.so", mode=ctypes.RTLD_GLOBAL)
        fn = lib.cudaMemcpyBatchAsync
    except (OSError, AttributeError):
        return None
    version = ctypes.c_int()
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 13000:
        # 12.8/12.9 take an extra failIdx argument: only the CUDA 13 signature is bound here.
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # const void* const* dsts
        ctypes.c_void_p,  # const void* const* srcs
        ctypes.c_void_p,  # const size_t* sizes
        ctypes.c_size_t,  # count
        ctypes.POINTER(_MemcpyAttributes),
        ctypes.POINTER(ctypes.c_size_t),  # attrsIdxs
        ctypes.c_size_t,  # numAttrs
        ctypes.c_void_p,  # cudaStream_t
    ]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def available() -> bool:
    return _runtime() is not None


def copy_pages_batched(
    src: torch.Tensor,
    src_ids: np.ndarray,
    dst: torch.Tensor,
    dst_ids: np.ndarray,
    stream: torch.cuda.Stream,
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] on the copy engines, queued on ``stream`` (not the legacy
    default stream). src [N, E] and dst [M, E] are contiguous-row 2-D views of GPU memory (either
    may be a peer's, mapped through CUDA IPC); ids are host int64 arrays (dst_ids distinct)."""
    lib = _runtime()
    if lib is None:
        raise RuntimeError("cudaMemcpyBatchAsync is not available in this CUDA runtime")
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(
            f"copy_pages_batched: expected [N, E] and [M, E] of one dtype, got {tuple(src.shape)} "
            f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}"
        )
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("copy_pages_batched: page rows must be contiguous")
    s0, d0, lengths = page_runs(src_ids, dst_ids)
    if lengths.size == 0:
        return
    if s0.min() < 0 or (s0 + lengths).max() > src.shape[0]:
        raise ValueError(f"copy_pages_batched: source page ids outside [0, {src.shape[0]})")
    if d0.min() < 0 or (d0 + lengths).max() > dst.shape[0]:
        raise ValueError(f"copy_pages_batched: destination page ids outside [0, {dst.shape[0]})")
    item = src.element_size()
    src_pitch, dst_pitch = src.stride(0) * item, dst.stride(0) * item
    row_bytes = src.shape[1] * item
    if (src_pitch != row_bytes or dst_pitch != row_bytes) and int(lengths.max()) > 1:
        raise ValueError("copy_pages_batched: runs need rows without gaps")
    srcs = (src.data_ptr() + s0 * src_pitch).astype(np.uint64)
    dsts = (dst.data_ptr() + d0 * dst_pitch).astype(np.uint64)
    sizes = (lengths * row_bytes).astype(np.uint64)
    attrs = _MemcpyAttributes(
        _SRC_ACCESS_ORDER_STREAM,
        _MemLocation(_LOCATION_DEVICE, src.device.index or 0),
        _MemLocation(_LOCATION_DEVICE, dst.device.index or 0),
        0,
    )
    idx = ctypes.c_size_t(0)
    with torch.cuda.device(stream.device):
        err = lib.cudaMemcpyBatchAsync(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            sizes.size,
            ctypes.byref(attrs),
            ctypes.byref(idx),
            1,
            stream.cuda_stream,
        )
    if err != 0:
        raise RuntimeError(
            f"cudaMemcpyBatchAsync failed: {lib.cudaGetErrorString(err).decode()} ({err})"
        )
