"""Bridges engine outputs (produced on the engine-loop thread) to an asyncio consumer."""

from __future__ import annotations

import asyncio
import threading
import weakref

from engine.outputs import RequestOutput


class _Inbox:
    """Outputs handed from another thread to one event loop, woken once per batch.

    ``call_soon_threadsafe`` writes to the loop's wake-up pipe on every call: once per output, a
    step of 16 requests made 16 system calls and 16 wake-ups on a worker's one CPU. Outputs pushed
    while a drain is already scheduled ride along with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[RequestOutput], output: RequestOutput) -> None:
        with self._lock:
            self._items.append((queue, output))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will read these
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, output in items:
            queue.put_nowait(output)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()
_inboxes_lock = threading.Lock()


def _inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    with _inboxes_lock:
        try:
            inbox = _inboxes.get(loop)
            if inbox is None:
                inbox = _inboxes[loop] = _Inbox(loop)
        except TypeError:  # a loop type without weak references: an inbox per stream
            inbox = _Inbox(loop)
        return inbox


class OutputStream:
    """An asyncio queue of one request's RequestOutputs, fed from another thread.

    ``push`` is the EngineLoop sink; ``get`` waits with a deadline (no wait without one, DESIGN 3.4).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._inbox = _inbox(loop)
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def push(self, output: RequestOutput) -> None:
        self._inbox.put(self._queue, output)

    async def get(self, timeout_s: float) -> RequestOutput:
        if not self._queue.empty():  # (no waiting task for an output already here)
            return self._queue.get_nowait()
        async with asyncio.timeout(timeout_s):  # (not wait_for: no task of its own per token)
            return await self._queue.get()
