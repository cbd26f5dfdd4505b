"""host_shm: P's memfd pools exported by file descriptor, opened read-only from the very files P
exported, and refused otherwise (the link then uses UCX)."""

from __future__ import annotations

import os

import pytest
import torch

from kvcache.kv_buffer import allocate_buffers
from tests.transfer.conftest import MODEL, specs
from transfer import paths
from transfer.page_table import PageTable
from transfer.paths.base import PoolsUnavailable
from transfer.paths.host_shm import HostShmPath, export_pools, open_pools
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
    opened = open_pools(export_pools(rows))
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


def test_an_export_naming_another_file_is_refused() -> None:
    rows, _ = _rows()
    pid, ns, pools = export_pools(rows)
    pools[0][3] += 1  # another inode
    with pytest.raises(PoolsUnavailable, match="not the file the peer exported"):
        open_pools([pid, ns, pools])
    with pytest.raises(PoolsUnavailable, match="another PID namespace"):
        open_pools([pid, ns + 1, pools])


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
