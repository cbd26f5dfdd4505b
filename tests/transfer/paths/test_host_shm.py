"""host_shm: P's memfd pools exported by file descriptor, opened read-only from the very files P
exported, and refused otherwise (the link then uses UCX)."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from kvcache.kv_buffer import allocate_buffers, shared_zeros
from tests.transfer.conftest import MODEL, specs
from transfer import paths
from transfer.page_table import PageTable
from transfer.paths.base import PoolsUnavailable
from transfer.paths.host_shm import HostShmPath, Populator, export_pools, open_pools
from transfer.paths.ucx import UcxPath
from transfer.pools import pool_rows


def _rows() -> tuple[dict[str, torch.Tensor], PageTable]:
    group = specs(two_groups=True)
    bufs = allocate_buffers(group, torch.device("cpu"))
    for b in bufs.values():
        b.copy_(torch.randn(b.shape))
    return pool_rows(bufs, {s.name: s.page_bytes for s in group}), PageTable.from_specs(
        MODEL, group
    )


def test_pools_open_read_only_from_the_files_p_exported() -> None:
    rows, _ = _rows()
    opened, populator = open_pools(export_pools(rows))
    populator.join(60)
    for name, r in rows.items():
        assert torch.equal(opened[name], r)
        assert opened[name].data_ptr() != r.data_ptr()  # a mapping of its own
    rows["full"][5] = 7
    assert (opened["full"][5] == 7).all()  # the same memory
    assert _permissions(opened["full"].data_ptr()) == "r--s"  # D can never write P's pages


def _permissions(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return perms
    raise AssertionError("address not mapped")


def _resident_bytes(address: int) -> int:
    """Bytes of the mapping holding ``address`` that have page table entries in this process."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start <= address < end
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError("address not mapped")


def test_the_mapping_of_written_pages_is_populated_once_per_link() -> None:
    rows, _ = _rows()  # every page written
    opened, populator = open_pools(export_pools(rows))
    populator.join(60)
    assert not populator.is_alive()
    for name, r in rows.items():
        size = r.untyped_storage().nbytes()
        assert _resident_bytes(opened[name].data_ptr()) == size  # no first read faults
        assert populator.populated_bytes >= size


def test_populating_leaves_the_pool_s_holes_unallocated() -> None:
    pool = shared_zeros((64, 4096), torch.uint8, "sparse")  # 64 pages, none taken yet
    pool[3] = 1
    pool[40:42] = 2
    fd, size = pool.untyped_storage()._share_fd_cpu_()
    opened, populator = open_pools(export_pools({"full": pool}))
    populator.join(60)
    assert os.fstat(fd).st_blocks * 512 == 3 * 4096  # P's pool took no page for D's sake
    assert _resident_bytes(opened["full"].data_ptr()) == 3 * 4096
    assert torch.equal(opened["full"], pool)  # holes still read as zeros


def test_a_stopped_populator_populates_nothing_more() -> None:
    pool = shared_zeros((16, 4096), torch.uint8, "stopped")
    pool.fill_(1)
    fd, size = pool.untyped_storage()._share_fd_cpu_()
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    halted = Populator([(mapped, 0, size)])
    HostShmPath({"full": pool}, halted).close()  # a link closed before its populating began
    halted.start()
    halted.join(60)
    assert halted.populated_bytes == 0
    working = Populator([(mapped, 0, size)])
    working.start()
    working.join(60)
    assert working.populated_bytes == size


def test_an_export_naming_another_file_is_refused() -> None:
    rows, _ = _rows()
    pid, ns, pools = export_pools(rows)
    pools[0][3] += 1  # another inode
    with pytest.raises(PoolsUnavailable, match="not the file the peer exported"):
        open_pools([pid, ns, pools])
    with pytest.raises(PoolsUnavailable, match="another PID namespace"):
        open_pools([pid, ns + 1, pools])


def test_a_pool_file_whose_size_may_change_is_refused() -> None:
    """D reads P's mapping at will: a file P could shrink would kill D (SIGBUS) on a read past
    its new end, so only a file whose size is sealed is mapped; P's pools are sealed, and their
    owner's alone."""
    rows, _ = _rows()
    fd = int(export_pools(rows)[2][0][1])
    assert os.fstat(fd).st_mode & 0o777 == 0o600
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 4096)
    nbytes = 16 * 4096
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    unsealed = {"full": torch.empty(0, dtype=torch.uint8).set_(storage, 0, (16, 4096))}
    with pytest.raises(PoolsUnavailable, match="size is not sealed"):
        open_pools(export_pools(unsealed))


def test_pools_outside_shared_memory_are_not_offered() -> None:
    kind, export = paths.offer({"full": torch.zeros(4, 16, dtype=torch.uint8)})
    assert (kind, export) == ("", b"")


def test_choose_opens_offered_pools_and_falls_back_to_ucx() -> None:
    rows, table = _rows()
    kind, export = paths.offer(rows)
    assert kind == "host_shm"
    path = paths.choose(export, table, rows)
    assert isinstance(path, HostShmPath) and torch.equal(path.peer_rows["full"], rows["full"])
    assert isinstance(paths.choose(b"", table, rows), UcxPath)
    assert isinstance(paths.choose(b"garbage", table, rows), UcxPath)
    bigger = PageTable.from_specs(MODEL, specs(num_pages=512, two_groups=True))
    assert isinstance(paths.choose(export, bigger, rows), UcxPath)  # pools smaller than promised
    assert paths.for_peer("host_shm", kind) is not None and paths.for_peer("cuda_ipc", kind) is None
    assert os.path.exists("/proc/self/fd")
