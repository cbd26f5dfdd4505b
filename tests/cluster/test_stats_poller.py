"""StatsPoller's bound on a worker's answer: a worker alive but stuck is marked unhealthy (the
router stops choosing it on stale stats) and its call is awaited again, not dropped: the records
its answer carries are kept, and its answer makes it healthy again."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from cluster import stats_poller
from cluster.stats_poller import StatsPoller
from cluster.worker_choice import WorkerSlot
from tests.tiny_engine import tiny_engine
from worker_common.messages import Role, StatsBatch, WorkerStats
from worker_common.worker_stats import transfer_totals


class _Answer:
    """An actor call's answer: awaitable again after an await of it was cancelled, as Ray's."""

    def __init__(self) -> None:
        self.batch: StatsBatch | None = None
        self.ready = asyncio.Event()

    def __await__(self) -> Generator[Any, None, StatsBatch]:
        async def wait() -> StatsBatch:
            await self.ready.wait()
            assert self.batch is not None
            return self.batch

        return wait().__await__()


class _StuckWorker:
    """``handle.drain_stats.remote()``: each call's answer comes only when the test gives it."""

    def __init__(self) -> None:
        self.calls: list[_Answer] = []
        self.drain_stats = self

    def remote(self) -> _Answer:
        self.calls.append(_Answer())
        return self.calls[-1]


def a_batch() -> StatsBatch:
    kv = tiny_engine(8).kv.stats()
    stats = WorkerStats("d-0", Role.DECODE, 1, True, 0, 0, 0, kv, None, transfer_totals({}), 3)
    return StatsBatch(stats, [], [])


def test_a_stuck_worker_is_marked_unhealthy_and_its_answer_still_taken(monkeypatch) -> None:
    monkeypatch.setattr(stats_poller, "ANSWER_S", 0.05)
    batch = a_batch()

    async def scenario() -> None:
        worker = _StuckWorker()
        slot = WorkerSlot("d-0", worker)
        poller = StatsPoller([slot], interval_s=0.01, max_stats_len=-1)
        poller.start()
        try:
            for _ in range(300):  # bounded: 3 s
                if not slot.healthy:
                    break
                await asyncio.sleep(0.01)
            assert not slot.healthy and len(worker.calls) == 1
            await asyncio.sleep(0.2)  # more rounds: the same call awaited, no second one
            assert len(worker.calls) == 1
            worker.calls[0].batch = batch
            worker.calls[0].ready.set()
            for _ in range(300):
                if poller.polls["d-0"]:
                    break
                await asyncio.sleep(0.01)
        finally:
            await poller.stop()
        assert (
            poller.polls["d-0"] >= 1
            and slot.healthy
            and slot.free_pages == batch.stats.kv.free == 7
        )

    asyncio.run(scenario())


class _FailingWorker:
    """``handle.drain_stats.remote()``: every call fails with ``error``, as Ray's would."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.drain_stats = self
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1

        async def fail() -> StatsBatch:
            raise self.error

        return fail()


def test_a_worker_ray_reports_dead_for_good_is_marked_dead_one_restarting_is_not() -> None:
    """ActorDiedError: Ray restarts it no more (the router never picks it again, the poller
    stops asking); a worker Ray is restarting fails its calls with ActorUnavailableError:
    unhealthy, not dead."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    async def scenario() -> tuple[WorkerSlot, WorkerSlot]:
        died = WorkerSlot("d-0", _FailingWorker(ActorDiedError()))
        restarting = WorkerSlot("d-1", _FailingWorker(ActorUnavailableError("restarting", None)))
        poller = StatsPoller([died, restarting], interval_s=0.01, max_stats_len=-1)
        poller.start()
        try:
            for _ in range(300):  # bounded: 3 s
                if not (died.healthy or restarting.healthy):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # (20 more intervals)
        finally:
            await poller.stop()
        return died, restarting

    died, restarting = asyncio.run(scenario())
    assert (died.healthy, died.dead) == (False, True)
    assert (restarting.healthy, restarting.dead) == (False, False)
    # A dead one is asked no more; one restarting is asked every interval until it answers.
    assert died.handle.calls == 1 and restarting.handle.calls > 5
