"""The host_shm path: CPU workers of one host, D reading P's pools from shared memory.

Host pools live in memfd files from the start (kvcache/kv_buffer.py). P exports each pool as its
file descriptor number with the file's device and inode; D opens it through /proc/<P's pid>/fd
(the same user and PID namespace), checks it is that very file, and maps it read-only: D can read
P's pages, never write them. The copy runs on D's transfer loop, where the pull is awaited
(paths/direct.py: the lease, the grant and the deadline).
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from transfer.mapper import Segment
from transfer.paths.base import PoolsUnavailable
from transfer.paths.direct import DirectPath, SegmentIds, copy_segments

if TYPE_CHECKING:
    from transfer.pull import PullSession


class HostShmPath(DirectPath):
    name = "host_shm"

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
        self.peer_rows = None  # the mappings go with the last tensor viewing them


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


def open_pools(export: Any) -> dict[str, torch.Tensor]:
    """P's pools, mapped read-only here, as [num_pages, page_bytes] uint8 rows."""
    pid, namespace, pools = export
    if namespace != _pid_namespace():
        raise PoolsUnavailable("the peer runs in another PID namespace")
    rows = {}
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
            mapped = mmap.mmap(own_fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(own_fd)  # the mapping keeps the file
        if page_bytes <= 0 or nbytes % page_bytes or offset < 0 or offset + nbytes > size:
            raise PoolsUnavailable(f"pool {name!r}: its rows do not lie in its file")
        with warnings.catch_warnings():  # read-only on purpose: D only reads P's pages
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
        rows[name] = flat[offset : offset + nbytes].view(-1, page_bytes)
    return rows


def _pid_namespace() -> int:
    """This process's PID namespace (0 if unknown): /proc/<pid> names P only inside P's."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
