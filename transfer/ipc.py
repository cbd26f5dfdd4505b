"""Direct page copies between pools of one host: the same-host data path.

A prefill worker exports its pools once (``export_pools``): CUDA IPC handles of the pool storage
when the KV lives on a GPU, the names of shared-memory files holding it when it lives in host
memory, and in every case a key into a per-process registry, so a decode side in the same process
finds the very tensors. It sends the export in HelloReply; the decode side opens it
(``open_pools``) and, when that works, reads every lease of that peer itself: one page-to-page copy
(a kernel over NVLink for two GPUs of one host, direct_copy.py; plain copies of page runs on the
CPU, host_copy.py) from P's pages into its own, checked against P's lease board (lease_board.py)
before and after. No message is on the latency path of such a pull, and P does no work for it.

Why D reads rather than P writes: a write by P needs a round trip through both processes' event
loops per pull (about 1 ms), far more than the copy of a typical request; D already knows its pages
and can start at once. A kernel launched by D on P's GPU would time-slice with P's prefill, so D
reads from its own GPU (the read kernel runs at a peer copy's speed: docs/benchmarks/transfer.md).

CUDA IPC needs P's GPU visible to the decode process (the cluster starts GPU workers with all of the
node's GPUs visible, see cluster/builder.py) and the same OS instance (``host_identity``). Host
pools are shared as files: memfd files from the start for the pools of kvcache.allocate_buffers,
anything else moved into an unlinked /dev/shm file when P exports it (which needs room there). D
opens them through /proc/<pid>/fd (the same user, host and PID namespace), checks that each is the
very file P exported, and maps it read-only. When a pool cannot be shared or opened the link stays
on UCX, and the handshake says why in the log.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import socket
import stat
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import torch

import kernels
from kvcache.spec import NULL_PAGE
from transfer.device_memory import DriverQueryFailed, mapped_end
from transfer.staging import word_rows

log = logging.getLogger(__name__)

# The copies skip any page id below this (the null page, which never moves) or past a pool: a
# direct read may queue its copy before its ids are checked (direct_read.py).
FIRST_ROW = NULL_PAGE + 1

SHM_DIR = "/dev/shm"  # where torch's sharing of host memory puts its files (shm_open)
SHM_HEADROOM = 256 << 20

# A host pool's handle: P's fd number, the file's device and inode, P's PID namespace.
_HOST_HANDLE = re.compile(rb"(\d+):(\d+):(\d+):(\d+)")

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
    """One pool's storage as another process opens it, and where the pool lies in it. GPU pools:
    the fields of torch's ``_share_cuda_``. Host pools: ``handle`` is ``fd:dev:inode:pidns``, P's
    file descriptor of the pool's shared-memory file (torch's ``_share_fd_cpu_``), which D opens
    through /proc and checks by device and inode, and P's PID namespace; both offsets are 0 and
    ``ref_counter_handle`` is empty."""

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
    pools: tuple[IpcPool, ...]  # empty when only a process of our own may read them

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


def export_pools(rows: Mapping[str, torch.Tensor], share: bool) -> IpcExport:
    """Export P's pool rows ([num_pages, page_bytes] uint8 views). Registered in this process (so
    a decode side here can read them) until ``unexport``; with ``share``, also for other
    processes of this host: CUDA IPC handles of GPU pools, shared-memory files for host pools.
    Host pools that are not in one already (kvcache's are memfd files) are moved into /dev/shm in
    place: tensors viewing them keep working, raw addresses taken before do not, and nothing may
    write them meanwhile. Raises IpcUnavailable if sharing fails."""
    first = next(iter(rows.values())).device
    on_gpu = first.type == "cuda"
    device = str(torch.cuda.get_device_properties(first).uuid) if on_gpu else "cpu"
    pools: tuple[IpcPool, ...] = ()
    if share:
        pools = _share_gpu_pools(rows) if on_gpu else _share_host_pools(rows)
    key = next(_KEYS)
    with _REGISTRY_LOCK:
        _REGISTRY[key] = dict(rows)
    return IpcExport(host_identity(), os.getpid(), key, device, pools)


def _where(name: str, r: torch.Tensor) -> tuple[str, int, int, int]:
    """The name, byte offset in its storage, bytes and page bytes of one pool."""
    return name, r.storage_offset() * r.element_size(), r.numel() * r.element_size(), r.shape[1]


def _share_gpu_pools(rows: Mapping[str, torch.Tensor]) -> tuple[IpcPool, ...]:
    pools = []
    for name, r in rows.items():
        storage = r.untyped_storage()
        try:
            # The IPC event torch also returns orders a consumer after the producer's pending
            # writes; P publishes a lease only after its device work on the pages has ended, so it
            # is not passed on.
            (_, handle, size, offset, rc_handle, rc_offset, _event, _sync) = storage._share_cuda_()
        except Exception as e:
            raise IpcUnavailable(f"cannot export pool {name!r}: {e}") from None
        name, byte_offset, nbytes, page_bytes = _where(name, r)
        pools.append(
            IpcPool(
                name,
                bytes(handle),
                int(size),
                int(offset),
                bytes(rc_handle),
                int(rc_offset),
                byte_offset,
                nbytes,
                page_bytes,
            )
        )
    return tuple(pools)


def _share_host_pools(rows: Mapping[str, torch.Tensor]) -> tuple[IpcPool, ...]:
    # Pools may share one storage: each storage is shared once.
    storages = {r.untyped_storage().data_ptr(): r.untyped_storage() for r in rows.values()}
    # The pools of kvcache.allocate_buffers are memfd files already; others (tests, tools) are
    # moved into /dev/shm here, in place. tmpfs pages are only taken when written: a copy into a
    # file larger than the room left would end in SIGBUS, not in an error, so the room is checked
    # first (with a margin for whatever else of this host writes there meanwhile).
    unshared = sum(s.nbytes() for s in storages.values() if not s.is_shared())
    if unshared:
        free = _shm_free_bytes()
        if unshared + SHM_HEADROOM > free:
            raise IpcUnavailable(
                f"{unshared / 2**20:.0f} MiB of host pools do not fit in {SHM_DIR} "
                f"({free / 2**20:.0f} MiB free, {SHM_HEADROOM / 2**20:.0f} MiB kept spare)"
            )
    namespace = _pid_namespace()
    handles = {}
    for storage in storages.values():
        try:
            # torch's file_descriptor sharing: an unlinked file that lives as long as an fd or a
            # mapping of it (nothing is left behind when P dies, and no manager process starts).
            fd, size = storage._share_fd_cpu_()
            st = os.fstat(fd)
        except Exception as e:  # e.g. shared already by file name
            raise IpcUnavailable(f"cannot share host pools: {e}") from None
        # Keyed by the storage's address after the move.
        handles[storage.data_ptr()] = (f"{fd}:{st.st_dev}:{st.st_ino}:{namespace}".encode(), size)
    pools = []
    for name, r in rows.items():
        handle, size = handles[r.untyped_storage().data_ptr()]
        name, byte_offset, nbytes, page_bytes = _where(name, r)
        pools.append(IpcPool(name, handle, int(size), 0, b"", 0, byte_offset, nbytes, page_bytes))
    return tuple(pools)


def _pid_namespace() -> int:
    """This process's PID namespace (0 if unknown): /proc/<pid> names P only inside P's."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        raise IpcUnavailable(f"no {SHM_DIR}: {e}") from None
    return st.f_bavail * st.f_frsize


def unexport(export: IpcExport) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(export.key, None)


def open_pools(
    export: IpcExport, own_rows: Mapping[str, torch.Tensor]
) -> tuple[str, dict[str, torch.Tensor]]:
    """Open P's exported pools for reading from this process (D, whose pools are ``own_rows``).
    Returns the data path ("local" for the same process, "cuda_ipc" or "host_shm" for another
    one) and P's rows by pool name. Raises IpcUnavailable when none works."""
    if export.host != host_identity():
        raise IpcUnavailable("the peer runs on another host")
    own = next(iter(own_rows.values())).device
    if export.pid == os.getpid():
        with _REGISTRY_LOCK:
            rows = _REGISTRY.get(export.key)
        if rows is None:
            raise IpcUnavailable("the peer's pools are no longer registered in this process")
        first = next(iter(rows.values()))
        if first.device.type != own.type:
            raise IpcUnavailable(f"pools on {first.device} and {own}")
        if first.device != own and first.device.type == "cuda":
            # A copy between scratch tensors makes torch enable peer access from our GPU to
            # theirs, which a kernel of ours reading their pages needs.
            torch.zeros(1, device=own).copy_(torch.zeros(1, device=first.device))
        return "local", dict(rows)
    if not export.pools:
        raise IpcUnavailable("another process, and its pools are not shared")
    if (export.device == "cpu") != (own.type == "cpu"):
        raise IpcUnavailable(f"pools on {export.device} and {own}")
    if own.type == "cpu":
        return "host_shm", _open_host_pools(export)
    return "cuda_ipc", _open_gpu_pools(export, own)


def _open_host_pools(export: IpcExport) -> dict[str, torch.Tensor]:
    """P's host pools mapped read-only here: a bug of ours cannot write P's KV."""
    rows = {}
    for p in export.pools:
        m = _HOST_HANDLE.fullmatch(p.handle)
        if m is None:
            raise IpcUnavailable(f"pool {p.name!r}: malformed host pool handle")
        fd_no, dev, ino, namespace = map(int, m.groups())
        if namespace != _pid_namespace():
            raise IpcUnavailable("the peer runs in another PID namespace")
        path = f"/proc/{export.pid}/fd/{fd_no}"  # ours to build: the export names no file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:  # P is gone, or this process may not open its files
            raise IpcUnavailable(f"cannot open pool {p.name!r}: {e}") from None
        try:
            st = os.fstat(fd)
            # The very file P exported (another process may hold that fd number now), whole.
            if (
                not stat.S_ISREG(st.st_mode)
                or (st.st_dev, st.st_ino) != (dev, ino)
                or st.st_size != p.storage_bytes
            ):
                raise IpcUnavailable(f"pool {p.name!r}: {path} is not the file the peer exported")
            mapped = mmap.mmap(fd, p.storage_bytes, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise IpcUnavailable(f"cannot map pool {p.name!r}: {e}") from None
        finally:
            os.close(fd)  # the mapping keeps the file
        with warnings.catch_warnings():  # read-only on purpose: D only reads P's pages
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        rows[p.name] = _pool_view(flat.untyped_storage(), p, torch.device("cpu"))
    return rows


def _open_gpu_pools(export: IpcExport, own: torch.device) -> dict[str, torch.Tensor]:
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
            _check_mapped(storage, p)
            rows[p.name] = _pool_view(storage, p, own)
    return rows


def _check_mapped(storage: torch.UntypedStorage, p: IpcPool) -> None:
    """The storage P claims must lie in memory mapped here: the sizes come from P, and a read
    beyond its mapping would fault our GPU context. (A mapping of ours that happens to follow P's
    would pass too: this guards against faults; the ids a read may use are checked against P's
    page table.)"""
    start = storage.data_ptr()
    try:
        end = mapped_end(start, start + p.storage_bytes)
    except DriverQueryFailed as e:
        raise IpcUnavailable(f"pool {p.name!r}: {e}") from None
    if start + p.storage_bytes > end:
        raise IpcUnavailable(
            f"pool {p.name!r}: the peer's {p.storage_bytes}-byte storage does not lie in the "
            f"memory its handle maps ({end - start} bytes from the storage's start)"
        )


def _pool_view(storage: torch.UntypedStorage, p: IpcPool, device: torch.device) -> torch.Tensor:
    """Pool ``p``'s [num_pages, page_bytes] rows in the opened storage."""
    if (
        p.page_bytes <= 0
        or p.nbytes % p.page_bytes
        or p.byte_offset < 0
        or p.byte_offset + p.nbytes > storage.nbytes()
    ):
        raise IpcUnavailable(
            f"pool {p.name!r}: {p.nbytes} bytes of {p.page_bytes}-byte pages at {p.byte_offset} "
            f"do not lie in its {storage.nbytes()}-byte storage"
        )
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage, p.byte_offset, (p.nbytes,))
    return flat.view(-1, p.page_bytes)


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
