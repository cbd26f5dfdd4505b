"""The data paths (base.py) and how a link picks one: P offers its pools (``offer``), D opens them
when it can (``choose``), and P takes the path D names (``for_peer``)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from transfer.page_table import PageTable
from transfer.paths.base import DataPath, PoolsUnavailable, PullFailed, ServeFailed
from transfer.paths.host_shm import HostShmPath
from transfer.paths.ucx import UcxPath

__all__ = ["DataPath", "PullFailed", "ServeFailed", "UcxPath", "choose", "for_peer", "offer"]

log = logging.getLogger(__name__)


def host_identity() -> str:
    """The OS instance: host name and boot id (direct reads work only within one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def offer(rows: Mapping[str, torch.Tensor]) -> tuple[str, bytes]:
    """P: (the direct path its pools allow, the export that goes in Welcome), or ("", b"")."""
    on_gpu = next(iter(rows.values())).device.type == "cuda"
    try:
        if on_gpu:
            from transfer.paths import cuda_ipc

            kind, body = "cuda_ipc", cuda_ipc.export_pools(rows)
        else:
            from transfer.paths import host_shm

            kind, body = "host_shm", host_shm.export_pools(rows)
    except PoolsUnavailable as e:
        log.warning("pools not offered for direct reads (%s): decode workers pull over UCX", e)
        return "", b""
    return kind, msgpack.packb([kind, host_identity(), body], use_bin_type=True)


def choose(export: bytes, peer: PageTable, own_rows: Mapping[str, torch.Tensor]) -> DataPath:
    """D: the path to a peer that sent ``export``: a direct path when its pools open here and hold
    every page its page table promises, else UCX. Blocking (it maps memory): run it off the loop."""
    if not export:
        return UcxPath()
    device = next(iter(own_rows.values())).device
    try:
        kind, host, body = msgpack.unpackb(export, raw=False)
        if host != host_identity():
            raise PoolsUnavailable("the peer runs on another host")
        path = _open(kind, body, device)
        assert path.peer_rows is not None
        for pool in peer.pools:
            rows = path.peer_rows.get(pool.name)
            if rows is None or rows.shape[0] < pool.num_pages or rows.shape[1] != pool.page_bytes:
                path.close()
                raise PoolsUnavailable(
                    f"the peer's pool {pool.name!r} is smaller than its page table"
                )
        return path
    except Exception as e:  # whatever fails here, UCX still works
        expected = isinstance(e, PoolsUnavailable) and "another host" in str(e)
        (log.info if expected else log.warning)("no direct reads from that peer (%s): UCX", e)
        return UcxPath()


def _open(kind: Any, body: Any, device: torch.device) -> HostShmPath:
    if kind == "host_shm" and device.type == "cpu":
        from transfer.paths import host_shm

        return HostShmPath(*host_shm.open_pools(body))
    if kind == "cuda_ipc" and device.type == "cuda":
        from transfer.paths import cuda_ipc

        return cuda_ipc.CudaIpcPath(cuda_ipc.open_pools(body, device), device)
    raise PoolsUnavailable(f"the peer offers {kind!r} pools, which do not open on {device.type}")


def for_peer(name: str, offered: str) -> DataPath | None:
    """P: the path a peer chose, if it is UCX or the one we offered."""
    if name == "ucx":
        return UcxPath()
    if name == offered == "host_shm":
        return HostShmPath()
    if name == offered == "cuda_ipc":
        from transfer.paths.cuda_ipc import CudaIpcPath

        return CudaIpcPath()
    return None
