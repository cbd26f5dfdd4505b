"""KVEventPublisher: a worker's KV events, in numbered batches, for the router's prefix index.

On the engine thread, after every step and round of calls (the engine loop's tick), the events the
KV cache manager recorded become one batch with the next sequence number, kept in a bounded outbox.
The router long-polls them (``poll``: batches after the last one it applied, waiting up to a
deadline for a new one); an outbox that overflowed loses its oldest batches, which the router sees
as a gap in the numbers and answers by asking for a snapshot (``snapshot``: every block the cache
can find now, and the number of the last batch it includes), from which it rebuilds its index.

``epoch`` names this publisher: a restarted worker gets a new one, so the router rebuilds then too
(sequence numbers start again at 0).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque

from engine.engine_core import LLMEngine
from worker_common.messages import KVEventBatch, KVEventPoll, KVSnapshot

MAX_BATCHES = 4096  # kept for the router between polls; older ones are dropped (a gap: rebuild)


class KVEventPublisher:
    def __init__(self, worker_id: str, engine: LLMEngine, max_batches: int = MAX_BATCHES) -> None:
        """Turns ``engine``'s KV events on (call before the engine loop starts)."""
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        engine.kv.enable_events()
        self._seq = 0
        self._outbox: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.dropped_for_test = 0  # batches dropped by ``drop_next_batch_for_test``
        self._drop_next = False

    # ---- engine thread ----
    def collect(self, engine: LLMEngine) -> None:
        """Turn the events recorded since the last call into one batch (the engine loop's tick)."""
        events = engine.kv.drain_events()
        if not events:
            return
        with self._lock:
            self._seq += 1
            batch = KVEventBatch(self.worker_id, self.epoch, self._seq, events)
            if self._drop_next:  # the test hook: this batch is lost on its way
                self._drop_next = False
                self.dropped_for_test += 1
            else:
                self._outbox.append(batch)
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def snapshot(self, engine: LLMEngine) -> KVSnapshot:
        """Every block the cache can find now, after the last batch it numbers (engine thread)."""
        self.collect(engine)
        with self._lock:
            seq = self._seq
        return KVSnapshot(self.worker_id, self.epoch, seq, engine.kv.cached_blocks())

    # ---- the actor's event loop ----
    async def poll(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll:
        """The batches numbered after ``after_seq``, waiting up to ``wait_s`` for one when there are
        none yet. An ``epoch`` other than this publisher's gets no batches (the caller rebuilds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            event = asyncio.Event()
            with self._lock:
                if epoch != self.epoch:
                    return KVEventPoll(self.epoch, [], self._seq)
                batches = [b for b in self._outbox if b.seq > after_seq]
                if batches or self._seq > after_seq:  # (a lost batch: answer now)
                    return KVEventPoll(self.epoch, batches, self._seq)
                self._waiters.append((loop, event))
            try:
                left = deadline - loop.time()
                if left <= 0:
                    return KVEventPoll(self.epoch, [], after_seq)
                async with asyncio.timeout(left):  # (not wait_for: it may lose a cancel)
                    await event.wait()
            except TimeoutError:
                return KVEventPoll(self.epoch, [], after_seq)
            finally:
                self._forget(loop, event)

    def _forget(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        """A poll that ends without a batch takes its waiter back: an idle worker's router polls
        every second, and the list is emptied only by the next batch."""
        with self._lock:
            if (loop, event) in self._waiters:
                self._waiters.remove((loop, event))

    @property
    def num_waiters(self) -> int:
        """Polls waiting for the next batch now."""
        with self._lock:
            return len(self._waiters)

    def drop_next_batch_for_test(self) -> None:
        """Test hook: the next batch is lost (as if the router never received it)."""
        with self._lock:
            self._drop_next = True
