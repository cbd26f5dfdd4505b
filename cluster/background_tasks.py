"""BackgroundTasks: one long-running task per worker on the server's event loop, started once
and cancelled together (the stats poller's and the KV event feed's)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, coros: Iterable[Coroutine[Any, Any, None]]) -> None:
        """Run ``coros`` as tasks on the running event loop, unless this set already runs (then
        the coroutines are closed unstarted)."""
        if self._tasks:
            for coro in coros:
                coro.close()
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(c) for c in coros]

    async def stop(self) -> None:
        """Cancel every task and wait for each to end (whatever it raised)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
