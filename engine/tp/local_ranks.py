"""The offline API's tensor-parallel ranks: ranks 1..tp-1 as local processes
(``python -m engine.tp.rank_main``, so callers need no ``if __name__ == "__main__"`` guard as
multiprocessing's spawn would), rank 0 the caller's process. A rank that fails exits its process;
its sockets close, so rank 0's next collective raises instead of waiting."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

import torch

from engine.engine_config import EngineConfig
from engine.tp.comm import TPGroup, open_store

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


class Ranks(Protocol):
    """Ranks 1..size-1 of a tensor-parallel engine, as rank 0 sees them."""

    group: TPGroup

    def close(self) -> None:
        """Tell the ranks to stop and wait for them."""
        ...

    def kill(self) -> None:
        """End the ranks now (after a failure)."""
        ...


StartRanks = Callable[[EngineConfig, int], Ranks]


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r's device: the r-th GPU of this host on CUDA, the CPU otherwise."""
    device = torch.device(config.device)
    return f"cuda:{rank}" if device.type == "cuda" else str(device)


class LocalRanks:
    """Spawns ranks 1..size-1 and joins rank 0 (this process) to their group."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        store = open_store()
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, size):
                p = subprocess.Popen(
                    [sys.executable, "-m", "engine.tp.rank_main"], stdin=subprocess.PIPE
                )
                self.processes.append(p)
                assert p.stdin is not None
                args = (config, rank, size, store.port, rank_device(config, rank))
                p.stdin.write(pickle.dumps(args))
                p.stdin.close()
            self.group = TPGroup.connect(
                0, size, store.port, torch.device(rank_device(config, 0)), store=store
            )
        except BaseException:
            self.kill()
            raise

    def close(self) -> None:
        """Tell the ranks to stop and wait for them (killed if they do not exit in time)."""
        try:
            if all(p.poll() is None for p in self.processes):
                self.group.broadcast_object(None)
        finally:
            for p in self.processes:
                try:
                    p.wait(JOIN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            self.kill()

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait(JOIN_TIMEOUT_S)
