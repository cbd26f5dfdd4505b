"""The host_shm path: CPU workers of one host, D reading P's pools from shared memory.

Host pools live in memfd files from the start (kvcache/kv_buffer.py). P exports each pool as its
file descriptor number with the file's device and inode; D opens it through /proc/<P's pid>/fd
(the same user and PID namespace), checks it is that very file, its size sealed, and maps it read-only: D can read
P's pages, never write them. The copy runs on D's transfer loop, where the pull is awaited
(paths/direct.py: the lease, the grant and the deadline).

Populating (``Populator``). A fresh mapping has no page table entries: the first read of each page
through it pays a minor fault, in whichever pull first reads it (on this 2-core host, 23 random
720 KiB rows out of a 1 GiB pool: 1.25-2.8 ms cold, 0.73 ms populated, ~0.45 ms warm). So once per
link D faults the mapping in ahead of the pulls with MADV_POPULATE_READ (Linux 5.14), which costs
about 110 ms per GiB here. Only the extents P has written (SEEK_DATA/SEEK_HOLE on the file) are
populated: a pool's pages are taken when first written or when P's own prefault thread reaches
them (kvcache/prefault.py, which P starts at allocation), and populating a hole from D would
allocate it on D's account (measured: MAP_POPULATE of a fresh 1 GiB pool took 1.3 s and made all
1 GiB resident), so pages P takes after the link opened still fault on D's first read. It runs in a
background thread, not in the handshake: a link to a P with several GiB written would otherwise
hold its first pull for ~0.1 s per GiB (and reach the connect deadline, 10 s, near 90 GiB), while
pulls that overlap the populating are merely as cold as without it. CPython 3.11's
``mmap.madvise`` keeps the GIL (during one 1 GiB call another Python thread ran at 5% of its idle
rate), so the thread populates in 8 MiB calls, between which D's loop and step threads run (60% of
their idle rate; populating then takes ~225 ms per GiB). It stops when the link closes. Measured
with scripts/bench_transfer.py (docs/benchmarks/transfer.md): the fixed cost of a 16 MiB pull
fell from 1.85 to 1.05 ms.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvcache.kv_buffer import SIZE_SEALS
from transfer.mapper import Segment
from transfer.paths.base import PoolsUnavailable
from transfer.paths.direct import DirectPath, SegmentIds, copy_segments

if TYPE_CHECKING:
    from transfer.pull import PullSession

log = logging.getLogger(__name__)

# Linux 5.14's value; CPython 3.11's mmap module lacks the name.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
POPULATE_CHUNK = 8 << 20  # bytes per madvise call: about 1 ms of holding the GIL


class HostShmPath(DirectPath):
    name = "host_shm"

    def __init__(
        self, peer_rows: dict[str, torch.Tensor] | None = None, populator: Populator | None = None
    ) -> None:
        """``populator``: the thread faulting ``peer_rows``' mappings in (D side), stopped on close."""
        super().__init__(peer_rows)
        self.populator = populator

    async def copy(
        self,
        pull: PullSession,
        segments: Sequence[Segment],
        deadline: float,
        ids: SegmentIds | None = None,
    ) -> None:
        # (CPU ids need no preparing.) (A copy of host memory is bounded work: it runs to its end, and fetch checks the time.)
        assert self.peer_rows is not None
        cpu = torch.device("cpu")
        await pull.r.runtime.copy(cpu, copy_segments, segments, self.peer_rows, pull.r.rows, cpu)

    def close(self) -> None:
        if self.populator is not None:
            self.populator.stop()
        self.peer_rows = None  # the mappings go with the last tensor viewing them (and populator)


class Populator(threading.Thread):
    """Faults in D's read-only mappings of the pages P has written, in the background (why, and
    why only those: the module docstring)."""

    def __init__(self, spans: list[tuple[mmap.mmap, int, int]]) -> None:
        """``spans``: (mapping, start, end) byte ranges to populate, page-aligned."""
        super().__init__(name="host_shm-populate", daemon=True)
        self._spans = spans
        self._halt = threading.Event()
        self.populated_bytes = 0

    def run(self) -> None:
        try:
            for mapped, start, end in self._spans:
                for at in range(start, end, POPULATE_CHUNK):
                    if self._halt.is_set():
                        return
                    length = min(POPULATE_CHUNK, end - at)
                    mapped.madvise(MADV_POPULATE_READ, at, length)
                    self.populated_bytes += length
        except (OSError, ValueError) as e:  # a kernel before 5.14 (EINVAL), a closed mapping
            log.info("host_shm mappings left to fault in lazily (%s)", e)
        finally:
            self._spans = []  # the mappings go when the link's tensors do

    def stop(self) -> None:
        self._halt.set()


def export_pools(rows: Mapping[str, torch.Tensor]) -> list[Any]:
    """[P's pid, its PID namespace, one entry per pool] for pools in shared memory; raises
    PoolsUnavailable for a pool that is not."""
    pools = []
    for name, r in rows.items():
        storage = r.untyped_storage()
        if r.device.type != "cpu" or not storage.is_shared():
            raise PoolsUnavailable(f"pool {name!r} is not in shared memory")
        try:
            fd, size = storage._share_fd_cpu_()  # the fd torch keeps for a shared storage
            st = os.fstat(fd)
        except Exception as e:  # shared by file name, say
            raise PoolsUnavailable(f"cannot export pool {name!r}: {e}") from None
        offset = r.storage_offset() * r.element_size()
        pools.append([name, fd, st.st_dev, st.st_ino, int(size), offset, r.numel(), r.shape[1]])
    return [os.getpid(), _pid_namespace(), pools]


def open_pools(export: Any) -> tuple[dict[str, torch.Tensor], Populator]:
    """P's pools, mapped read-only here, as [num_pages, page_bytes] uint8 rows; and the started
    thread that populates the mappings."""
    pid, namespace, pools = export
    if namespace != _pid_namespace():
        raise PoolsUnavailable("the peer runs in another PID namespace")
    rows = {}
    spans: list[tuple[mmap.mmap, int, int]] = []
    for name, fd, dev, ino, size, offset, nbytes, page_bytes in pools:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            own_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:  # P is gone, or we may not open its files
            raise PoolsUnavailable(f"cannot open pool {name!r}: {e}") from None
        try:
            st = os.fstat(own_fd)
            # The very file P exported (another file may have that fd number by now), whole.
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size) != (
                dev,
                ino,
                size,
            ):
                raise PoolsUnavailable(f"pool {name!r}: {path} is not the file the peer exported")
            if fcntl.fcntl(own_fd, fcntl.F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
                # (a file that may shrink under the mapping kills this process on a read past
                # its new end)
                raise PoolsUnavailable(f"pool {name!r}: its file's size is not sealed")
            mapped = mmap.mmap(own_fd, size, prot=mmap.PROT_READ)
            spans += [(mapped, start, end) for start, end in written_extents(own_fd, size)]
        finally:
            os.close(own_fd)  # the mapping keeps the file
        if page_bytes <= 0 or nbytes % page_bytes or offset < 0 or offset + nbytes > size:
            raise PoolsUnavailable(f"pool {name!r}: its rows do not lie in its file")
        with warnings.catch_warnings():  # read-only on purpose: D only reads P's pages
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        rows[name] = flat[offset : offset + nbytes].view(-1, page_bytes)
    populator = Populator(spans)
    populator.start()
    return rows, populator


def written_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the file's first ``size`` bytes that hold pages, holes left out."""
    extents = []
    at = 0
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past ``at``
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if start < end:
            extents.append((start, end))
        at = end
    return extents


def _pid_namespace() -> int:
    """This process's PID namespace (0 if unknown): /proc/<pid> names P only inside P's."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
