"""Direct page copies between pools of one host: the same-host data path.

A prefill worker exports its pools once (``export_pools``): CUDA IPC handles of the pool storage
when the KV lives on a GPU, and in every case a key into a per-process registry, so a decode side
in the same process finds the very tensors. It sends the export in HelloReply; the decode side
opens it (``open_pools``) and, when that works, reads every lease of that peer itself: one
page-to-page copy kernel (``kernels.copy_pages``, over NVLink for two GPUs of one host) on its own
GPU, from P's pages into its own, checked against P's lease board (lease_board.py) before and after.
No message is on the latency path of such a pull, and P's GPU does no work for it.

Why D reads rather than P writes: a write by P needs a round trip through both processes' event
loops per pull (about 1 ms), far more than the copy of a typical request; D already knows its pages
and can start at once. A kernel launched by D on P's GPU would time-slice with P's prefill, so D
reads from its own GPU (the read kernel runs at a peer copy's speed: docs/benchmarks/transfer.md).

CUDA IPC needs P's GPU visible to the decode process (the cluster starts GPU workers with all of the
node's GPUs visible, see cluster/builder.py) and the same OS instance (``host_identity``). When a
pool cannot be opened the link stays on UCX, and the handshake says why in the log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import msgpack
import numpy as np
import torch

import kernels
from kvcache.spec import NULL_PAGE
from transfer.plan import DirectPlan
from transfer.staging import word_rows

log = logging.getLogger(__name__)

# The copies skip any page id below this (the null page, which never moves) or past a pool: a
# direct read may queue its copy before its ids are checked (direct_read.py).
FIRST_ROW = NULL_PAGE + 1

_REGISTRY: dict[int, dict[str, torch.Tensor]] = {}  # export key -> rows, this process only
_REGISTRY_LOCK = threading.Lock()
_KEYS = itertools.count(1)


class IpcUnavailable(Exception):
    """The peer's pools cannot be opened here; the link uses UCX instead."""


def host_identity() -> str:
    """The OS instance: hostname plus boot id (two containers of one host share the boot id, but
    CUDA IPC and the process registry only work within one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class IpcPool:
    """One GPU pool's storage as CUDA IPC sees it (the fields of torch's ``_share_cuda_``), and
    where the pool lies in it."""

    name: str
    handle: bytes
    storage_bytes: int
    storage_offset: int  # of the storage in its CUDA allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    byte_offset: int  # of the pool in the storage
    nbytes: int
    page_bytes: int


@dataclass(frozen=True)
class IpcExport:
    host: str
    pid: int
    key: int  # into the exporting process's registry
    device: str  # "cpu", or the GPU's UUID
    pools: tuple[IpcPool, ...]

    def to_wire(self) -> bytes:
        pools = [[getattr(p, f) for f in _POOL_FIELDS] for p in self.pools]
        return msgpack.packb([self.host, self.pid, self.key, self.device, pools], use_bin_type=True)

    @classmethod
    def from_wire(cls, data: bytes) -> IpcExport:
        """Raises IpcUnavailable for anything malformed (the link then simply stays on UCX)."""
        try:
            host, pid, key, device, pools = msgpack.unpackb(data, raw=False)
            parsed = tuple(IpcPool(*p) for p in pools)
            export = cls(host, pid, key, device, parsed)
        except Exception as e:
            raise IpcUnavailable(f"malformed pool export ({type(e).__name__}: {e})") from None
        for p in parsed:
            for f, kind in _POOL_FIELDS.items():
                if type(getattr(p, f)) is not kind:
                    raise IpcUnavailable(f"malformed pool export: {p.name!r}.{f}")
        return export


_POOL_FIELDS = {
    "name": str,
    "handle": bytes,
    "storage_bytes": int,
    "storage_offset": int,
    "ref_counter_handle": bytes,
    "ref_counter_offset": int,
    "byte_offset": int,
    "nbytes": int,
    "page_bytes": int,
}


def export_pools(rows: Mapping[str, torch.Tensor], cuda_ipc: bool) -> IpcExport:
    """Export P's pool rows ([num_pages, page_bytes] uint8 views). Registered in this process (so
    a decode side here can read them) until ``unexport``; with ``cuda_ipc`` and GPU pools, also
    as CUDA IPC handles. Raises IpcUnavailable if CUDA IPC export fails."""
    first = next(iter(rows.values())).device
    on_gpu = first.type == "cuda"
    device = str(torch.cuda.get_device_properties(first).uuid) if on_gpu else "cpu"
    pools = []
    if on_gpu and cuda_ipc:
        for name, r in rows.items():
            storage = r.untyped_storage()
            try:
                # The IPC event torch also returns orders a consumer after the producer's pending
                # writes; P publishes a lease only after its device work on the pages has ended,
                # so it is not passed on.
                (_, handle, size, offset, rc_handle, rc_offset, _event, _sync) = (
                    storage._share_cuda_()
                )
            except Exception as e:
                raise IpcUnavailable(f"cannot export pool {name!r}: {e}") from None
            pools.append(
                IpcPool(
                    name,
                    bytes(handle),
                    int(size),
                    int(offset),
                    bytes(rc_handle),
                    int(rc_offset),
                    r.storage_offset() * r.element_size(),
                    r.numel() * r.element_size(),
                    r.shape[1],
                )
            )
    key = next(_KEYS)
    with _REGISTRY_LOCK:
        _REGISTRY[key] = dict(rows)
    return IpcExport(host_identity(), os.getpid(), key, device, tuple(pools))


def unexport(export: IpcExport) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(export.key, None)


def open_pools(
    export: IpcExport, own_rows: Mapping[str, torch.Tensor]
) -> tuple[str, dict[str, torch.Tensor]]:
    """Open P's exported pools for reading from this process (D, whose pools are ``own_rows``).
    Returns the data path ("local" for the same process, "cuda_ipc") and P's rows by pool name.
    Raises IpcUnavailable when neither works."""
    if export.host != host_identity():
        raise IpcUnavailable("the peer runs on another host")
    if export.pid == os.getpid():
        with _REGISTRY_LOCK:
            rows = _REGISTRY.get(export.key)
        if rows is None:
            raise IpcUnavailable("the peer's pools are no longer registered in this process")
        first, own = next(iter(rows.values())), next(iter(own_rows.values()))
        if first.device.type != own.device.type:
            raise IpcUnavailable(f"pools on {first.device} and {own.device}")
        if first.device != own.device and first.device.type == "cuda":
            # A copy between scratch tensors makes torch enable peer access from our GPU to
            # theirs, which a kernel of ours reading their pages needs.
            torch.zeros(1, device=own.device).copy_(torch.zeros(1, device=first.device))
        return "local", dict(rows)
    own = next(iter(own_rows.values())).device
    if own.type != "cuda" or not export.pools:
        raise IpcUnavailable("another process, and no CUDA IPC export on both sides")
    peer = _visible_index(export.device)
    local = own.index if own.index is not None else torch.cuda.current_device()
    if peer != local and not torch.cuda.can_device_access_peer(local, peer):
        raise IpcUnavailable(f"GPU {local} cannot access peer GPU {peer}")
    rows = {}
    with torch.cuda.device(local):
        for p in export.pools:
            try:
                # Opened in *this* GPU's context (the index we pass), with peer access enabled
                # lazily by CUDA: the tensor is labelled cuda:<local> but addresses P's memory,
                # which is what a kernel launched here needs.
                storage = torch.UntypedStorage._new_shared_cuda(
                    local,
                    p.handle,
                    p.storage_bytes,
                    p.storage_offset,
                    p.ref_counter_handle,
                    p.ref_counter_offset,
                    b"",  # no IPC event (see export_pools); torch wants bytes here
                    False,
                )
            except Exception as e:
                raise IpcUnavailable(f"cannot open pool {p.name!r}: {e}") from None
            flat = torch.empty(0, dtype=torch.uint8, device=own)
            flat.set_(storage, p.byte_offset, (p.nbytes,))
            rows[p.name] = flat.view(-1, p.page_bytes)
    return "cuda_ipc", rows


def _visible_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise IpcUnavailable(f"the peer's GPU {uuid} is not visible to this process")


def warm_up(own_rows: Mapping[str, torch.Tensor]) -> None:
    """Compile the copy kernel now rather than in the first handshake or pull (page 0 onto
    itself: a no-op)."""
    zero = torch.zeros(1, dtype=torch.int64, device=next(iter(own_rows.values())).device)
    for r in own_rows.values():
        kernels.copy_pages(word_rows(r), zero, word_rows(r), zero, FIRST_ROW)


def copy_on_cpu(
    plan: DirectPlan,
    src_rows: Mapping[str, torch.Tensor],
    dst_rows: Mapping[str, torch.Tensor],
) -> None:
    """Copy every page of ``plan`` from P's rows into D's, both in host memory (the same process);
    done when this returns. Copies on GPUs go through transfer/direct_copy.py. Pairs with an id
    outside the pools, or the null page, are skipped (FIRST_ROW)."""
    for sp, dp, s, d in plan.pairs:
        ids = torch.from_numpy(np.stack([s, d]))
        kernels.copy_pages(
            word_rows(src_rows[sp]), ids[0], word_rows(dst_rows[dp]), ids[1], FIRST_ROW
        )


class Completion(Protocol):
    """A queued copy's end: a CUDA event, or transfer.direct_copy.QueuedCopy."""

    def query(self) -> bool: ...


async def wait_copy(event: Completion | None, timeout: float) -> bool:
    """Wait (without blocking the loop) until the copy's event completes; False after ``timeout``."""
    if event is None:
        return True
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not event.query():
        waited = loop.time() - start
        if waited > timeout:
            return False
        await asyncio.sleep(_poll_pause(waited))
    return True


def wait_copy_blocking(event: Completion | None, timeout: float) -> bool:
    """``wait_copy`` for plain threads; False after ``timeout``. It keeps the GIL for the first
    200 us (most copies end by then): a pause would hand the GIL to another thread of the process,
    such as the transceiver's loop, and the pull would wait for that thread's whole turn."""
    if event is None:
        return True
    start = time.monotonic()
    while not event.query():
        waited = time.monotonic() - start
        if waited > timeout:
            return False
        if waited > 0.0002:
            time.sleep(_poll_pause(waited))
    return True


def _poll_pause(waited: float) -> float:
    """A copy takes microseconds to a few ms: poll back to back (latency) for the first 20 ms,
    then every millisecond to spare the core."""
    return 0.0 if waited < 0.02 else 0.001
