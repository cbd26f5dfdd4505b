"""Waiting for a direct read's queued copy: from an event loop without blocking it, or on a plain
thread (direct_read.py); waiting out work that writes a caller's pages after the caller gave up
(``outlast_cancels``); and the copies that outlived their pull (``LateCopies``)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Completion(Protocol):
    """A queued copy's end: a CUDA event, or transfer.direct_copy.QueuedCopy."""

    def query(self) -> bool: ...


async def wait_copy(event: Completion | None, timeout: float) -> bool:
    """Wait (without blocking the loop) until the copy's event completes; False after ``timeout``."""
    if event is None:
        return True
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not event.query():
        waited = loop.time() - start
        if waited > timeout:
            return False
        await asyncio.sleep(_poll_pause(waited))
    return True


def wait_copy_blocking(event: Completion | None, timeout: float) -> bool:
    """``wait_copy`` for plain threads; False after ``timeout``. It keeps the GIL for the
    interpreter's switch interval (5 ms: copies of up to about 1.5 GiB end by then): a pause would
    hand the GIL to another thread of the process, and the pull would wait for that thread's whole
    turn (0.03-0.06 of a peer copy's speed at 128-512 MiB on 2 H200s: docs/benchmarks/
    transfer.md). A thread that wants the GIL meanwhile gets it after that interval anyway, as it
    would from any Python code running here."""
    if event is None:
        return True
    start = time.monotonic()
    spin = sys.getswitchinterval()
    while not event.query():
        waited = time.monotonic() - start
        if waited > timeout:
            return False
        if waited > spin:
            time.sleep(_poll_pause(waited))
    return True


def _poll_pause(waited: float) -> float:
    """A copy takes microseconds to a few ms: poll back to back (latency) for the first 20 ms,
    then every millisecond to spare the core."""
    return 0.0 if waited < 0.02 else 0.001


async def outlast_cancels(fut: asyncio.Future, timeout: float | None = None) -> bool:
    """Wait until ``fut`` is done even when the waiting task is cancelled again meanwhile; False
    if it was not done within ``timeout``. For a pull the caller cancelled: the caller frees the
    pages it gave as soon as we return, so nothing may still write them then, however many
    cancels arrive (every step of a pull has a deadline, so ``fut`` ends on its own; ``timeout``
    only bounds a wait on a transceiver that stopped working). The caller re-raises its own
    CancelledError afterwards."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while not fut.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return False
        try:
            await asyncio.wait([fut], timeout=left)
        except asyncio.CancelledError:
            continue
    return True


class LateCopies:
    """D's direct copies that were still running when their pull ended (past its deadline, or
    cancelled): their pages went back to the caller, and may be handed to another pull. Our
    streams are ordered after such a copy (DirectRead fences the model's stream behind it), but UCX
    writes a chunk straight into pool memory outside any stream of ours, so a pull that receives
    that way first waits for these (pull.py). Thread-safe: reads end on callers' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[Completion] = []

    def add(self, copy: Completion) -> None:
        with self._lock:  # (ended ones dropped here too: a side that never pulls over UCX)
            self._running = self._still_running()
            self._running.append(copy)

    def pending(self) -> bool:
        """Whether some are still running (the ended ones are dropped)."""
        with self._lock:
            self._running = self._still_running()
            return bool(self._running)

    def _still_running(self) -> list[Completion]:
        return [c for c in self._running if not c.query()]

    async def wait(self, timeout: float, stop: Callable[[], bool]) -> bool:
        """Wait (without blocking the loop) until every copy added so far has ended, or ``stop()``
        (then True: the caller checks why); False after ``timeout`` in all."""
        with self._lock:
            running = list(self._running)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for copy in running:
            while not copy.query():
                waited = loop.time() - start
                if stop():
                    return True
                if waited > timeout:
                    return False
                await asyncio.sleep(_poll_pause(waited))
        return True
