"""The offline API's tensor-parallel ranks: ranks 1..tp-1 as local processes
(``python -m engine.tp.rank_main``, so callers need no ``if __name__ == "__main__"`` guard as
multiprocessing's spawn would), rank 0 the caller's process. A rank that fails exits its process;
its sockets close, so rank 0's next collective raises instead of waiting."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

import torch

from engine.cpu_share import configure_cpu_threads, usable_cores
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
    """Rank r's device: on CUDA the r-th GPU counted from rank 0's, ``config.device`` ("cuda":
    the current one, which a cluster worker set to the GPU Ray gave it), the CPU otherwise.
    (Rank 0 was always "cuda:0": a cluster worker's rank 0 loaded its weights on GPU 0 of the
    node, whatever GPU Ray had given it.)"""
    device = torch.device(config.device)
    if device.type != "cuda":
        return str(device)
    base = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{base + rank}"


class LocalRanks:
    """Spawns ranks 1..size-1 and joins rank 0 (this process) to their group."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        """Ranks on this host: on CUDA, the ``size`` GPUs from rank 0's (a cluster worker's
        ranks are Ray actors instead, each on the GPU Ray gives it: worker_common/tp_ranks.py)."""
        kind = torch.device(config.device).type
        last = torch.device(rank_device(config, size - 1))
        if kind == "cuda" and last.index >= torch.cuda.device_count():
            raise ValueError(
                f"LLM.tensor_parallel_size={size} needs GPUs {rank_device(config, 0)} to "
                f"{last}; this host has {torch.cuda.device_count()}"
            )
        env = None
        self._threads_before = torch.get_num_threads()  # (rank 0's, given back at the end)
        if kind == "cpu":
            # The host's cores split between the ranks, as a cluster worker's ranks split its
            # CPUs: each rank with torch's default of every core ran 3 ranks x 2 threads on 2
            # cores 5x slower than 1 thread each (vLLM binds each rank's threads to its cores).
            threads = max(1, usable_cores() // size)
            configure_cpu_threads(threads)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        store = open_store()
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, size):
                p = subprocess.Popen(
                    [sys.executable, "-m", "engine.tp.rank_main"], stdin=subprocess.PIPE, env=env
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
        torch.set_num_threads(self._threads_before)
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait(JOIN_TIMEOUT_S)
