"""LoopProgress: UCX progressed by the transceiver's own event loop, with no thread of ucxx's.

While data messages of ours are in flight (``messages``), the loop polls UCX once per turn: a
pull's bytes need progress calls to move (TCP segments, rendezvous replies), and every waiter of
a message checks its completion each turn anyway. With none in flight, the loop arms UCX's event
descriptor and sleeps until it fires (a peer's message, a failed endpoint), with a progress call
every ``IDLE_PROGRESS_S`` for anything UCX does without an event: an idle worker costs no CPU.

Why not ucxx's own modes: "thread" wakes a progress thread and then a notifier thread, which
hands each completion to the loop. On this 2-core VM, scattered 720 KiB host pages over TCP,
three rounds alternating, each mode's raw baseline progressed as its pulls are
(docs/benchmarks/transfer.md, "UCX progressed on the loop"): a 16 MiB pull's ratio to raw ucxx's
one message 0.53-0.63 here against 0.48-0.51 in "thread", 64 MiB 0.61-0.67 against 0.48-0.51
(32.5-39.7 ms against 42.7-58.8); idle after a pull, 0.006 CPU seconds per second against
0.012-0.046. ucxx's "blocking" mode does not arm the
descriptor again after its first event, so from then on its loop spins a core while idle
(measured: 1.0 CPU second per second); "polling" spins from the start. This class keeps what
polling gains while data moves and sleeps when there is nothing to move.

ucxx's context starts a progress task for its loop as it is made; ``take_over`` makes it in
"polling" mode (whose task has not run yet), cancels that task and puts this in its place in
ucxx's table of progress tasks, so that no endpoint or listener starts another for the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# Longest an idle loop goes without a progress call: UCX's keepalives and endpoint teardown
# need progress without always raising an event.
IDLE_PROGRESS_S = 0.05


class LoopProgress:
    @classmethod
    def take_over(
        cls, make_context: Callable[[str], Any], loop: asyncio.AbstractEventLoop
    ) -> tuple[Any, LoopProgress]:
        """A ucxx context made by ``make_context(progress_mode)`` on ``loop`` (running it), and
        this progress for it in place of ucxx's."""
        from ucxx._lib_async.application_context import ProgressTasks

        ctx = make_context("polling")
        ucxx_task = ProgressTasks.pop(loop)
        ucxx_task.progress_task.cancel()  # (made on this turn of the loop: it never ran)
        progress = cls(ctx.worker, loop)
        ProgressTasks[loop] = progress
        return ctx, progress

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        """(ucxx's polling mode has set the worker up for an event descriptor.)"""
        self.worker = worker
        self.loop = loop
        self.in_flight = 0
        self.calls = 0  # progress calls (tests read both counts)
        self.polls = 0  # of which while messages were in flight
        self._wake = asyncio.Event()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self._wake.set)
        self._task = loop.create_task(self._run())

    @contextlib.contextmanager
    def messages(self) -> Iterator[None]:
        """Around a data message's send or receive: the loop polls UCX until it ends."""
        self.in_flight += 1
        self._wake.set()
        try:
            yield
        finally:
            self.in_flight -= 1

    async def _run(self) -> None:
        worker = self.worker
        while True:
            worker.progress()
            self.calls += 1
            if self.in_flight:
                self.polls += 1
                await asyncio.sleep(0)  # one poll per turn of the loop
                continue
            self._wake.clear()
            if not worker.arm():  # events UCX has not handled yet: progress again first
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_PROGRESS_S):
                    await self._wake.wait()

    def stop(self) -> None:
        """Stop progressing (on the loop); UCX's context is shut down after this."""
        self._task.cancel()
        with contextlib.suppress(Exception):  # (the loop may be closing)
            self.loop.remove_reader(self._fd)

    # ucxx's progress tasks compare by their loop
    def __hash__(self) -> int:
        return hash(self.loop)

    def __eq__(self, other: object) -> bool:
        return hash(self) == hash(other)
