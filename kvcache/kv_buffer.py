"""The KV storage tensors of the pool groups and the per-layer views attention reads."""

from __future__ import annotations

import fcntl
import math
import os

import torch

from kvcache.prefault import prefault
from kvcache.spec import PoolGroupSpec


def allocate_buffers(specs: list[PoolGroupSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """One zeroed tensor per group, shaped ``spec.buffer_shape`` (page-major, see kvcache/spec.py).

    Zeroed, not empty: kernels read whole pages and mask by length, and masked garbage that happens to
    be NaN would still poison ``0 * v`` in the weighted sum.

    Host pools live in anonymous shared memory (``shared_zeros``), so that a decode worker of the
    same host can read a prefill worker's pages (transfer/paths/host_shm.py) without the pools being copied.
    Their pages are faulted in by a background thread from the start (kvcache/prefault.py).
    """
    if device.type == "cpu":
        pools = {s.name: shared_zeros(s.buffer_shape, s.dtype, s.name) for s in specs}
        for pool in pools.values():
            prefault(pool)
        return pools
    return {s.name: torch.zeros(s.buffer_shape, dtype=s.dtype, device=device) for s in specs}


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    """A zeroed host tensor in a memfd file (Linux): shared memory another process of this user can
    map through /proc/<pid>/fd, with no name in /dev/shm and no limit but the host's memory (a
    /dev/shm file would compete with Ray's object store for that mount). Pages are taken when
    first written, as for any zeroed allocation. Plain host memory where memfd is missing."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(os, "memfd_create"):
        return torch.zeros(shape, dtype=dtype)
    try:
        fd = os.memfd_create(f"duet-kv-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    try:
        os.ftruncate(fd, nbytes)
        seal_size(fd)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps it; keeps a dup
    except (OSError, RuntimeError):
        return torch.zeros(shape, dtype=dtype)
    finally:
        os.close(fd)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def seal_size(fd: int) -> None:
    """Fix the memfd's size for good and make it its owner's alone. A process that maps the file
    (a decode worker's host_shm path) reads its pages at will, and would die of SIGBUS on a read
    past an end that moved; it checks the seals before it maps (transfer/paths/host_shm.py).
    (A memfd is made mode 0777; /proc/<pid>/fd asks for ptrace rights to P anyway, 0600 says
    so on the file too.)"""
    os.fchmod(fd, 0o600)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)


SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def layer_view(buffer: torch.Tensor, local_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of the group's ``local_layer``-th layer, each a strided view
    [num_pages, page_size, Hkv, D] of ``buffer`` [num_pages, Hkv, num_layers, 2, page_size, D]."""
    # [num_pages, Hkv, page_size, D] -> [num_pages, page_size, Hkv, D]
    return (
        buffer[:, :, local_layer, 0].transpose(1, 2),
        buffer[:, :, local_layer, 1].transpose(1, 2),
    )


def layer_views(
    specs: list[PoolGroupSpec], buffers: dict[str, torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Model layer id -> (k_cache, v_cache), each a strided view [num_pages, page_size, Hkv, D]."""
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for spec in specs:
        buf = buffers[spec.name]
        for local, layer_id in enumerate(spec.layer_ids):
            if layer_id in views:
                raise ValueError(f"layer {layer_id} appears in more than one pool group")
            views[layer_id] = layer_view(buf, local)
    return views
