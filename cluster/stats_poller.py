"""StatsPoller: the server's background collection of every worker's stats.

One task per worker on the server's event loop: every ``stats.interval_s`` it asks the worker for
a StatsBatch (``drain_stats``: its WorkerStats, and the iteration stats and transfer records since
the previous call) and keeps the records in buffers of its own, per worker, under one lock, with
the ``max_stats_len`` rule (-1 all, 0 none, N the newest N). /iteration_stats, /transfer_stats and
/metrics read those buffers and the last WorkerStats; they never wait on a worker.

A worker that answers late delays only its own task, and its answer is awaited, never dropped: the
records it drained are in that answer. One that has not answered within ANSWER_S is marked
unhealthy (alive but stuck, the router would otherwise keep sending it requests on stale stats);
the same call is awaited again next interval, and its answer makes it healthy again. A worker that
died loses nothing already collected from it; its task marks it unhealthy and asks again next
interval while Ray restarts it (ActorUnavailableError), and stops once Ray reports it dead for
good (ActorDiedError: the worker is marked dead, cluster/worker_choice.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from cluster.background_tasks import BackgroundTasks
from cluster.worker_choice import WorkerSlot, note_unavailable
from engine.stats import StatsBuffer
from worker_common.messages import StatsBatch

log = logging.getLogger(__name__)

ANSWER_S = 10.0  # a worker's stats are due within this (it answers between engine steps)


class StatsPoller:
    def __init__(
        self,
        workers: list[WorkerSlot],
        interval_s: float,
        max_stats_len: int,
        on_taken: Callable[[WorkerSlot], None] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.workers = workers
        # Told of each batch taken (its stats now the worker's last_stats): the frontend counts
        # the worker's running totals there, not only when /metrics is read, or a restarted
        # process's first batch replaced the old one's last before anyone counted it.
        self.on_taken = on_taken
        self.interval_s = interval_s
        self.max_stats_len = max_stats_len
        self._lock = threading.Lock()  # the buffers: poll tasks append, endpoints drain
        self._iterations = {w.worker_id: StatsBuffer[Any](max_stats_len) for w in workers}
        self._transfers = {w.worker_id: StatsBuffer[Any](max_stats_len) for w in workers}
        self._tasks = BackgroundTasks()
        self.polls = {w.worker_id: 0 for w in workers}  # batches taken per worker

    def start(self) -> None:
        """Start one poll task per worker on the running event loop (once)."""
        self._tasks.start(self._poll(w) for w in self.workers)

    async def stop(self) -> None:
        await self._tasks.stop()

    async def _poll(self, w: WorkerSlot) -> None:
        pending: Any = None  # a call not answered yet: its answer holds drained records
        while True:
            if pending is None:
                pending = w.handle.drain_stats.remote()
            try:
                async with asyncio.timeout(max(ANSWER_S, self.interval_s)):
                    batch: StatsBatch = await pending
            except TimeoutError:
                w.healthy = False
                log.warning(
                    "stats of %s: no answer within %gs, marked unhealthy",
                    w.worker_id,
                    max(ANSWER_S, self.interval_s),
                )
                await asyncio.sleep(self.interval_s)
                continue
            except RayActorError as e:
                note_unavailable(w, e)  # restarting (healthy again once it answers), or dead
                if w.dead:  # (it will never answer: no warning every interval for good)
                    log.warning("stats of %s: dead for good, no longer asked: %s", w.worker_id, e)
                    return
                log.warning("stats of %s unavailable: %s", w.worker_id, e)
            except RayTaskError as e:
                log.warning("stats of %s failed: %s", w.worker_id, e)
            else:
                self.take(w, batch)
            pending = None
            await asyncio.sleep(self.interval_s)

    def take(self, w: WorkerSlot, batch: StatsBatch) -> None:
        """Keep one batch of worker ``w`` (the poll task's step; also for tests)."""
        with self._lock:
            iterations, transfers = self._iterations[w.worker_id], self._transfers[w.worker_id]
            for it in batch.iterations:
                iterations.append(it)
            for t in batch.transfers:
                transfers.append(t)
            self.polls[w.worker_id] += 1
        w.last_stats = batch.stats
        w.healthy = batch.stats.healthy
        w.free_pages = batch.stats.kv.free  # (of its fullest group: KVCacheStats.free)
        if self.on_taken is not None:
            self.on_taken(w)

    def drain_iterations(self) -> list[dict[str, Any]]:
        """Every iteration record collected since the last drain, per worker in order, as JSON
        objects with the worker's id (``iteration`` numbers each worker's steps: 1, 2, ...)."""
        return self._drain(self._iterations, lambda it: asdict(it))

    def drain_transfers(self) -> list[dict[str, Any]]:
        """Every transfer record collected since the last drain, as JSON objects."""
        return self._drain(self._transfers, lambda t: {**asdict(t), "gbps": t.gbps})

    def _drain(self, buffers: dict[str, StatsBuffer[Any]], plain: Any) -> list[dict[str, Any]]:
        with self._lock:
            drained = {worker_id: buf.drain() for worker_id, buf in buffers.items()}
        return [
            {"worker_id": worker_id, **plain(record)}
            for worker_id, records in drained.items()
            for record in records
        ]
