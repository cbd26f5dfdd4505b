"""KVEventFeed against a real engine's KV events (worker_common.KVEventPublisher, as a worker
keeps them): the router's index follows the cache batch by batch, a lost batch or a restarted
worker triggers a rebuild from a snapshot, and the index then equals the cache again."""

from __future__ import annotations

import asyncio

import pytest

from cluster import kv_event_feed
from cluster.kv_event_feed import KVEventFeed, WorkerFeed
from cluster.kv_index import KVIndex
from engine.engine_core import LLMEngine
from tests.tiny_engine import greedy, tiny_engine
from worker_common.kv_events import KVEventPublisher
from worker_common.messages import KVEventPoll, KVSnapshot


class PublisherSource:
    """The worker actor's two calls, without Ray: the same publisher, called directly."""

    def __init__(self, publisher: KVEventPublisher, engine: LLMEngine) -> None:
        self.publisher, self.engine = publisher, engine

    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll:
        return await self.publisher.poll(epoch, after_seq, wait_s)

    async def snapshot(self) -> KVSnapshot:
        return self.publisher.snapshot(self.engine)


def run(engine: LLMEngine, publisher: KVEventPublisher, rid: str, prompt: list[int]) -> None:
    """One request to the end, with the engine loop's tick after every step."""
    engine.add_request(rid, prompt, greedy(2))
    while engine.has_unfinished():
        engine.step()
        publisher.collect(engine)


def index_matches_cache(index: KVIndex, engine: LLMEngine) -> bool:
    held = index.workers["p-0"].groups
    return {
        g: {m: set(hashes) for m, hashes in by_medium.items() if hashes}
        for g, by_medium in engine.kv.cached_blocks().items()
    } == {g: {m: hs for m, hs in by_medium.items() if hs} for g, by_medium in held.items()}


def test_batches_apply_in_order_and_a_lost_batch_rebuilds() -> None:
    async def scenario() -> None:
        engine = tiny_engine(12)  # 11 usable pages of 4 tokens: prompts below evict each other
        publisher = KVEventPublisher("p-0", engine)
        index = KVIndex(["p-0"])
        feed = WorkerFeed("p-0", PublisherSource(publisher, engine), index)
        await feed.step(wait_s=0.0)  # first contact: a snapshot (of an empty cache)
        assert index.rebuilds["p-0"] == 1 and feed.seq == 0

        run(engine, publisher, "a", list(range(1, 18)))
        await feed.step(wait_s=0.0)
        assert index.rebuilds["p-0"] == 1 and index.batches["p-0"] == feed.seq > 0
        assert index_matches_cache(index, engine)
        hashes = engine.kv.cached_blocks()["full"]["device"]
        assert index.cached_prefix("p-0", hashes, 4).device_pages == 4  # 17 tokens: 4 full pages

        publisher.drop_next_batch_for_test()
        run(engine, publisher, "b", list(range(30, 50)))  # its only batch is lost
        await feed.step(wait_s=0.0)  # the worker's latest number tells: a rebuild
        assert feed.gaps == 1 and index.rebuilds["p-0"] == 2
        assert index_matches_cache(index, engine)

        run(engine, publisher, "c", list(range(60, 90)))  # evicts a's pages: removed events
        await feed.step(wait_s=0.0)
        assert feed.gaps == 1 and index_matches_cache(index, engine)
        assert index.cached_prefix("p-0", hashes, 4).device_pages < 4

        restarted = KVEventPublisher("p-0", engine)  # a new epoch: the worker restarted
        feed.source = PublisherSource(restarted, engine)
        await feed.step(wait_s=0.0)
        assert index.rebuilds["p-0"] == 3 and feed.epoch == restarted.epoch
        assert index_matches_cache(index, engine)

    asyncio.run(scenario())


def test_a_poll_waits_for_the_next_batch() -> None:
    async def scenario() -> None:
        engine = tiny_engine(12)
        publisher = KVEventPublisher("p-0", engine)
        epoch = publisher.epoch
        waiting = asyncio.ensure_future(publisher.poll(epoch, 0, wait_s=30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        # Collected on another thread, as the engine loop does: the poll wakes up.
        await asyncio.to_thread(run, engine, publisher, "a", list(range(1, 10)))
        poll = await asyncio.wait_for(waiting, 10.0)
        assert poll.epoch == epoch and [b.seq for b in poll.batches][0] == 1
        assert (await publisher.poll(epoch, poll.batches[-1].seq, wait_s=0.0)).batches == []
        assert (await publisher.poll("old", 0, wait_s=0.0)).batches == []  # another epoch
        assert publisher.num_waiters == 0

    asyncio.run(scenario())


def test_idle_polls_leave_no_waiter_behind() -> None:
    """An idle worker's router polls every second and no batch comes: each poll that times out,
    or is cancelled, takes its waiter back (they piled up until the next batch, about 1 KB each)."""

    async def scenario() -> None:
        engine = tiny_engine(12)
        publisher = KVEventPublisher("p-0", engine)
        for _ in range(20):
            poll = await publisher.poll(publisher.epoch, 0, wait_s=0.001)
            assert poll.batches == []
        cancelled = asyncio.ensure_future(publisher.poll(publisher.epoch, 0, wait_s=30.0))
        await asyncio.sleep(0.05)
        assert publisher.num_waiters == 1
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert publisher.num_waiters == 0

    asyncio.run(scenario())


class SilentSource:
    """A worker alive but stuck: its calls never answer."""

    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def snapshot(self) -> KVSnapshot:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def test_a_silent_worker_is_forgotten_not_waited_for(monkeypatch) -> None:
    """A worker whose poll never answers: its task gives up on the poll's bound, forgets what the
    worker held (the router then assumes nothing cached there) and asks again, instead of
    trusting a stale index for ever."""
    monkeypatch.setattr(kv_event_feed, "ANSWER_SLACK_S", 0.05)
    monkeypatch.setattr(kv_event_feed, "RETRY_S", 0.01)

    async def scenario() -> None:
        index = KVIndex(["p-0"])
        index.rebuild("p-0", {"full": {"device": [11, 12]}})
        feed = KVEventFeed({"p-0": SilentSource()}, index)
        feed.start()
        try:
            for _ in range(500):  # bounded: 5 s (a poll waits 1 s, then its slack)
                if not index.workers["p-0"].groups:
                    break
                await asyncio.sleep(0.01)
        finally:
            await feed.stop()
        assert not index.workers["p-0"].groups

    asyncio.run(scenario())


class FailingSource:
    """A worker whose every call fails as Ray's ``error`` says: dead for good (restarts spent),
    or unavailable (restarting)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> None:
        self.calls += 1
        raise self.error

    snapshot = poll  # type: ignore[assignment]


@pytest.mark.parametrize("dead", [True, False])
def test_a_dead_worker_is_asked_no_more(monkeypatch, dead: bool) -> None:
    """Its feed ends, as the stats poller stops polling such a worker (it was asked twice a
    second, a warning each time, for the cluster's life); a worker that is only unavailable
    (restarting) is asked again."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    monkeypatch.setattr(kv_event_feed, "RETRY_S", 0.01)
    error = ActorDiedError() if dead else ActorUnavailableError("restarting", None)

    async def scenario() -> int:
        index = KVIndex(["d-0"])
        index.rebuild("d-0", {"full": {"device": [11]}})
        source = FailingSource(error)
        feed = KVEventFeed({"d-0": source}, index)
        feed.start()
        try:
            await asyncio.sleep(0.3)  # (30 retries' time)
        finally:
            await feed.stop()
        assert not index.workers["d-0"].groups  # forgotten either way
        return source.calls

    calls = asyncio.run(scenario())
    assert calls == 1 if dead else calls > 1, calls
