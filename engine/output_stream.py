"""Bridges engine outputs (produced on the engine-loop thread) to an asyncio consumer."""

from __future__ import annotations

import asyncio

from engine.outputs import RequestOutput


class OutputStream:
    """An asyncio queue of one request's RequestOutputs, fed from another thread.

    ``push`` is the EngineLoop sink; ``get`` waits with a deadline (no wait without one, DESIGN 3.4).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def push(self, output: RequestOutput) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def get(self, timeout_s: float) -> RequestOutput:
        return await asyncio.wait_for(self._queue.get(), timeout_s)
