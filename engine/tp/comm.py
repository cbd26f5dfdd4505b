"""TPGroup: the collectives of one tensor-parallel worker's ranks, without torch.distributed's
global default group (several engines may live in one process, e.g. tests and the offline API).

Two process groups over one TCPStore that rank 0 hosts: ``control`` (gloo, CPU) carries each
step's typed message from rank 0 to the others as pickled bytes; ``data`` carries the row-parallel
all-reduces (NCCL on CUDA, the same gloo group on CPU). Everything binds to ``host`` (127.0.0.1 in
tests); rank 0's store listens on a free port that the other ranks are told.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def open_store(host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store, on a free port of ``host`` (``store.port``)."""
    return dist.TCPStore(
        host,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def arrived_key(rank: int) -> str:
    return f"arrived/{rank}"


ARRIVAL_POLL_S = 0.05


def wait_arrivals(
    store: dist.TCPStore,
    size: int,
    problem: Callable[[], str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Rank 0, before joining the group: wait until ranks 1..size-1 reached the store, raising
    RuntimeError with ``problem()`` as soon as it says one (a rank's process that exited at
    start-up), rather than waiting out the group's timeout for a rank that will never come."""
    keys = [arrived_key(r) for r in range(1, size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        said = problem()
        if said:
            raise RuntimeError(said)
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys, 1) if not store.check([k])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not start in {timeout_s}s")
        time.sleep(ARRIVAL_POLL_S)


@dataclass
class TPGroup:
    rank: int
    size: int
    control: dist.ProcessGroup
    data: dist.ProcessGroup
    store: dist.TCPStore

    @classmethod
    def connect(
        cls,
        rank: int,
        size: int,
        port: int,
        device: torch.device,
        host: str = "127.0.0.1",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        store: dist.TCPStore | None = None,
    ) -> TPGroup:
        """Join the group (blocks until all ``size`` ranks have joined). Rank 0 passes the store
        that ``open_store`` made; the others connect to ``host:port``."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside [0, {size})")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, None, False, timeout=timeout)
            store.set(arrived_key(rank), "1")  # (rank 0 may be watching for it: wait_arrivals)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, opts)
        data: dist.ProcessGroup = control
        if device.type == "cuda":
            nccl_opts = dist.ProcessGroupNCCL.Options()
            data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, size, nccl_opts)
        return cls(rank, size, control, data, store)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        self.data.allreduce([tensor]).wait()
        return tensor

    def broadcast_object(self, obj: object | None = None) -> object:
        """Rank 0 sends ``obj`` (picklable, CPU tensors); every rank returns it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast(payload, 0).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(payload.numpy().tobytes())
