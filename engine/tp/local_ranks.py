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
import time
from collections.abc import Callable
from typing import Protocol

import torch

from engine.cpu_share import configure_cpu_threads, usable_cores
from engine.engine_config import EngineConfig
from engine.tp.comm import TPGroup, open_store, wait_arrivals

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


class TPRanksLost(RuntimeError):
    """A tensor-parallel step failed on the way: the other ranks were stopped, and the engine
    runs no more steps."""


class Ranks(Protocol):
    """Ranks 1..size-1 of a tensor-parallel engine, as rank 0 sees them."""

    group: TPGroup

    def close(self) -> None:
        """Tell the ranks to stop and wait for them."""
        ...

    def kill(self) -> None:
        """End the ranks now (after a failure)."""
        ...

    def stop_after_failure(self, wait: bool) -> str:
        """End the ranks after a step failed; which of them had ended on their own, and how
        ("" if none is known to have): ``wait``, a moment for a failing rank to end first."""
        ...


StartRanks = Callable[[EngineConfig, int], Ranks]


def stop_after_failed_step(ranks: Ranks, failure: BaseException, why: str) -> None:
    """Stop ``ranks`` after rank 0's step failed between its step message and its last
    collective (``failure``; ``why``: the runner's account of it): left inside the step's
    collectives, they would wait there out the group's timeout, and every later step with them.
    Raises TPRanksLost naming the rank that ended, when one did; an interrupt goes on as it is."""
    ended = ranks.stop_after_failure(wait=isinstance(failure, Exception))
    if isinstance(failure, Exception):
        raise TPRanksLost(
            f"a tensor-parallel step failed ({ended or why}); the other ranks were stopped"
        ) from failure


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


# A rank that failed is on its way out when rank 0's collective fails: its exit code says how.
EXIT_GRACE_S = 2.0


class _CallerThreads:
    """Rank 0's torch threads while local CPU ranks share the host: taken at the first
    LocalRanks, given back when the last one ends (each saving what it found would leave the
    caller the count of an earlier LLM's rank 0)."""

    def __init__(self) -> None:
        self.users = 0
        self.before = 0

    def take(self) -> None:
        if self.users == 0:
            self.before = torch.get_num_threads()
        self.users += 1

    def give_back(self) -> None:
        self.users -= 1
        if self.users == 0:
            torch.set_num_threads(self.before)


_CALLER_THREADS = _CallerThreads()


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
        self.processes: list[subprocess.Popen[bytes]] = []
        _CALLER_THREADS.take()
        self._threads_taken = True
        try:
            if kind == "cpu":
                # The host's cores split between the ranks, as a cluster worker's ranks split
                # its CPUs: each rank with torch's default of every core ran 3 ranks x 2 threads
                # on 2 cores 5x slower than 1 thread each (vLLM binds each rank's threads to its
                # cores).
                threads = max(1, usable_cores() // size)
                configure_cpu_threads(threads)
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            store = open_store()
            for rank in range(1, size):
                p = subprocess.Popen(
                    [sys.executable, "-m", "engine.tp.rank_main"], stdin=subprocess.PIPE, env=env
                )
                self.processes.append(p)
                assert p.stdin is not None
                args = (config, rank, size, store.port, rank_device(config, rank))
                p.stdin.write(pickle.dumps(args))
                p.stdin.close()
            wait_arrivals(store, size, self.ended)
            self.group = TPGroup.connect(
                0, size, store.port, torch.device(rank_device(config, 0)), store=store
            )
        except BaseException:
            self.kill()
            raise

    def ended(self) -> str:
        """Which ranks' processes have exited, and how ("" while all run)."""
        return "; ".join(
            f"tensor-parallel rank {rank} exited with code {p.returncode}"
            for rank, p in enumerate(self.processes, 1)
            if p.poll() is not None
        )

    def stop_after_failure(self, wait: bool) -> str:
        deadline = time.monotonic() + (EXIT_GRACE_S if wait else 0.0)
        while not self.ended() and time.monotonic() < deadline:
            time.sleep(0.05)
        said = self.ended()
        self.kill()
        return said

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
        if self._threads_taken:  # (once: kill ends close, and may come again)
            self._threads_taken = False
            _CALLER_THREADS.give_back()
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait(JOIN_TIMEOUT_S)
