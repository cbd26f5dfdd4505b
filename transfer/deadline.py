"""Bounded waits on a transfer's hot path without the task ``asyncio.wait_for`` makes per call
before Python 3.12: each such task costs its waiter one more loop step (and with the GIL shared
with UCX's threads, a step can cost tens of microseconds), per chunk and per control message."""

from __future__ import annotations

import asyncio
import sys
from typing import TypeVar

T = TypeVar("T")


async def next_item(queue: asyncio.Queue[T], timeout: float) -> T:
    """``queue.get()`` within ``timeout`` seconds; raises TimeoutError after it. An item that is
    already there is taken without suspending."""
    if not queue.empty():
        return queue.get_nowait()
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), timeout)
