"""One live call per request id on a decode worker.

The worker keys everything by request id: its pages in the KV cache manager, its place in the
scheduler, the router's abort. A second call with an id still live here (the router's retry on
the same worker after Ray reported it unreachable, while the first call in fact ran on) would
take the first one's pages, or have them freed under it while it runs. So a call takes its id's
slot first, waiting for an earlier call of the same id to end (the router aborts that one before
it retries), and gives it back only once nothing it started can still touch the id's pages.

A slot also carries what an abort needs to know: whether the request has reached the engine yet
(before that, the abort is a flag the call reads at its next step; after, the engine aborts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable


class CallSlot:
    """The slot of one call: ``aborted`` (the router's abort came before the request reached the
    engine), ``in_engine`` (the add is queued: an abort now goes to the engine)."""

    def __init__(self, on_release: Callable[[CallSlot], None]) -> None:
        self.aborted = False
        self.in_engine = False
        self._ended = asyncio.Event()
        self._kept = False
        self._on_release = on_release

    def keep(self) -> None:
        """Hold the slot past the call's end: the caller calls ``release`` once the pages its
        call took are freed (a pull still in flight when the client left, say)."""
        self._kept = True

    def release(self) -> None:
        if not self._ended.is_set():
            self._ended.set()
            self._on_release(self)


class CallSlots:
    """The live calls of one worker's event loop, by request id."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._slots: dict[str, CallSlot] = {}

    def get(self, rid: str) -> CallSlot | None:
        return self._slots.get(rid)

    @contextlib.asynccontextmanager
    async def hold(self, rid: str) -> AsyncIterator[CallSlot]:
        """The slot of ``rid`` for the body; an earlier call's is waited for, up to ``wait_s``
        (then RuntimeError: that call is stuck, and this one cannot run beside it)."""
        deadline = time.monotonic() + self.wait_s
        while (earlier := self._slots.get(rid)) is not None:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    await earlier._ended.wait()
            except TimeoutError:
                raise RuntimeError(
                    f"an earlier call for {rid} still runs on this worker after {self.wait_s}s "
                    "(decode.page_wait_deadline_s)"
                ) from None
        slot = self._slots[rid] = CallSlot(lambda s: self._drop(rid, s))
        try:
            yield slot
        finally:
            if not slot._kept:
                slot.release()

    def _drop(self, rid: str, slot: CallSlot) -> None:
        if self._slots.get(rid) is slot:
            del self._slots[rid]
