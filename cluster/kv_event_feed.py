"""KVEventFeed: the server's subscription to every worker's KV events, kept in a KVIndex.

One task per worker on the server's event loop long-polls the worker's batches
(worker_common/kv_events.py) and applies them in order. Whenever the numbers do not follow on
(a batch was lost, or the worker's outbox overflowed) or the worker's epoch changed (first contact,
or a restart), the task takes a snapshot of the worker's cache and rebuilds that worker's index
from it, then goes on from the snapshot's number. A worker that does not answer, or not in time,
is forgotten (the router assumes it holds nothing) until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from cluster.background_tasks import BackgroundTasks
from cluster.kv_index import KVIndex
from worker_common.messages import KVEventPoll, KVSnapshot

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # how long one poll waits on the worker for a new batch
RETRY_S = 0.5  # after a worker did not answer
# A worker that is alive but silent (its loop stuck) must not freeze its task: a poll's answer is
# due within its wait plus this, a snapshot (taken between engine steps) within SNAPSHOT_S.
ANSWER_SLACK_S = 10.0
SNAPSHOT_S = 10.0


class KVEventSource(Protocol):
    """Where one worker's events come from (its actor, through ``ActorSource``)."""

    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll: ...
    async def snapshot(self) -> KVSnapshot: ...


class ActorSource:
    """A worker actor's ``kv_events`` / ``kv_snapshot`` calls."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll:
        return await self.handle.kv_events.remote(epoch, after_seq, wait_s)

    async def snapshot(self) -> KVSnapshot:
        return await self.handle.kv_snapshot.remote()


class WorkerFeed:
    """One worker's position in its event stream."""

    def __init__(self, worker_id: str, source: KVEventSource, index: KVIndex) -> None:
        self.worker_id = worker_id
        self.source = source
        self.index = index
        self.epoch: str | None = None
        self.seq = 0
        self.gaps = 0  # rebuilds because a batch was missing (not counting first contacts)

    async def step(self, wait_s: float = POLL_WAIT_S) -> None:
        """One poll: apply the batches that follow on, or rebuild from a snapshot."""
        async with asyncio.timeout(wait_s + ANSWER_SLACK_S):
            poll = await self.source.poll(self.epoch, self.seq, wait_s)
        if poll.epoch != self.epoch:
            await self._rebuild()
            return
        for batch in poll.batches:
            if batch.seq <= self.seq:
                continue  # included in the snapshot we rebuilt from
            if batch.seq != self.seq + 1:
                break
            self.index.apply(self.worker_id, batch.events)
            self.seq = batch.seq
        if self.seq < poll.last_seq:  # a batch did not come: lost, or pushed out of the outbox
            log.warning(
                "KV events of %s: batch %d missing (latest %d): rebuilding its index",
                self.worker_id,
                self.seq + 1,
                poll.last_seq,
            )
            self.gaps += 1
            await self._rebuild()

    async def _rebuild(self) -> None:
        async with asyncio.timeout(SNAPSHOT_S):
            snapshot = await self.source.snapshot()
        self.index.rebuild(self.worker_id, snapshot.blocks)
        self.epoch, self.seq = snapshot.epoch, snapshot.seq


class KVEventFeed:
    def __init__(self, sources: dict[str, KVEventSource], index: KVIndex) -> None:
        self.index = index
        self.feeds = {w: WorkerFeed(w, source, index) for w, source in sources.items()}
        self._tasks = BackgroundTasks()

    def start(self) -> None:
        """One task per worker on the running event loop (once)."""
        self._tasks.start(self._run(f) for f in self.feeds.values())

    async def stop(self) -> None:
        await self._tasks.stop()

    async def _run(self, feed: WorkerFeed) -> None:
        while True:
            try:
                await feed.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the feed must outlive any one failed call
                if isinstance(e, ActorDiedError) and not isinstance(e, RayTaskError):
                    # Dead for good (Ray's restarts spent; a restarting worker's calls fail as
                    # unavailable): as the stats poller, stop asking (it was asked twice a second,
                    # a warning each time, for the cluster's life).
                    log.warning("KV events of %s: the worker is dead: %s", feed.worker_id, e)
                    self.index.forget(feed.worker_id)
                    return
                if isinstance(e, (RayActorError, RayTaskError, TimeoutError)):
                    log.warning("KV events of %s unavailable: %s", feed.worker_id, e)
                else:
                    log.exception("KV events of %s: unexpected failure", feed.worker_id)
                self.index.forget(feed.worker_id)
                feed.epoch = None  # a snapshot when it answers again
                await asyncio.sleep(RETRY_S)
