"""DirectRead: the decode side of one pull on a direct link, where D reads P's pages itself.

    check the ticket (compatibility, pages, declared == expected) -> P's lease board: the lease is
    live, names exactly the ticket's request and pages, and P declares the expected prompt length
    -> one copy kernel from P's pages into ours, on our GPU -> the board again: the same lease is
    still live (otherwise P may have reused the pages during the copy, and the pull fails) ->
    ReadDone to P in the background (P releases its pages).

Nothing waits for P: the whole pull runs on the caller's thread (``run_blocking``) or event loop
(``run``), with no hop to the transceiver's loop, so it costs the copy plus tens of microseconds.
P learns of it from ReadDone; if that is lost, the lease expires as usual. A failure once the lease
was found live (a declared-history mismatch, a forged ticket, a cancelled pull) also sends
ReadDone, so both sides get their pages back at once. A pull returns only when its copy has ended,
or, past the deadline, with D's model stream ordered after it. KV is never trimmed or padded: any
mismatch fails the pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from transfer.ipc import start_copy, wait_copy, wait_copy_blocking
from transfer.lease_board import lease_digest
from transfer.mapper import MapperError
from transfer.messages import ReadDone, TransferTicket
from transfer.peer import DirectAccess, PeerLink
from transfer.plan import DirectPlan, direct_plan
from transfer.pull_checks import PullFailed, check_declared, source_pages
from transfer.stats import TransferResult, TransferStats

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class DirectRead:
    def __init__(
        self,
        receiver: KVReceiver,
        link: PeerLink,
        access: DirectAccess,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> None:
        self.r = receiver
        self.link = link
        self.access = access  # held here: the link drops its own reference when it closes
        self.ticket = ticket
        self.dst = dst_page_ids
        self.skip = skip_pages
        self.expected = expected_prompt_len
        self.plan: DirectPlan | None = None
        self._word = 0  # the lease's board word when the read began
        self._event: torch.cuda.Event | None = None  # the copy's, on GPUs
        self._start = time.perf_counter()

    async def run(self) -> TransferResult:
        """The read, waiting for the copy without blocking the caller's event loop."""
        try:
            self._check()
            if self.r.rows_on_gpu:
                event = self._launch()
                copied = await wait_copy(event, self.r.config.chunk_deadline_s)
            else:  # a CPU copy takes the core: off the loop, on the transceiver's copy thread
                await asyncio.get_running_loop().run_in_executor(
                    self.r.runtime.copy_executor, self._launch
                )
                copied = True
            return self._finish(copied)
        except PullFailed as e:
            return self._fail(str(e))
        except asyncio.CancelledError:  # the caller gave up: P gets its pages back now
            self._fail("the pull was cancelled")
            raise

    def run_blocking(self) -> TransferResult:
        """The read on a plain thread (it waits for the copy on this thread)."""
        try:
            self._check()
            copied = wait_copy_blocking(self._launch(), self.r.config.chunk_deadline_s)
            return self._finish(copied)
        except PullFailed as e:
            return self._fail(str(e))

    def _check(self) -> None:
        t = self.ticket
        # Arrays once: the digest, the checks and the upload of the ids all want them.
        pages = {g: np.asarray(ids, dtype=np.int64) for g, ids in t.page_ids.items()}
        src = source_pages(t, self.r.page_table, self.dst, self.skip, pages)
        word, declared, digest = self.access.board.entry(t.lease_slot)
        if word != (t.lease_gen << 1) | 1:
            raise PullFailed(
                f"the lease of request {t.request_id!r} ended (expired, or released) before the "
                "read: the prefill worker no longer holds its pages"
            )
        self._word = word
        if digest != lease_digest(t.request_id, pages):
            raise PullFailed(
                f"the ticket's pages of {t.request_id!r} differ from the ones the prefill worker "
                "leased"
            )
        check_declared(declared, self.expected)
        try:
            self.plan = direct_plan(self.link.info.page_table, self.r.page_table, src, self.dst)
        except (MapperError, ValueError) as e:
            raise PullFailed(f"cannot map the pages: {e}") from None

    def _launch(self) -> torch.cuda.Event | None:
        assert self.plan is not None
        try:
            self._event = start_copy(self.plan, self.access.rows, self.r.rows)
        except (RuntimeError, ValueError) as e:  # a launch that failed never started copying
            raise PullFailed(f"the page copy failed: {e}") from None
        return self._event

    def _fence_unfinished_copy(self) -> None:
        """A pull that ends before its copy did (deadline, cancel) hands back pages the copy may
        still write: the model's stream then waits for the copy before it runs anything more, and
        every later copy into those pages waits for the model's stream (ipc.start_copy)."""
        event = self._event
        if event is not None and not event.query():
            log.error(
                "the page copy of %s is still running after its pull ended; the model's stream "
                "waits for it",
                self.ticket.request_id,
            )
            torch.cuda.default_stream(self.r.device).wait_event(event)

    def _finish(self, copied: bool) -> TransferResult:
        if not copied:
            raise PullFailed(
                f"the page copy did not end within {self.r.config.chunk_deadline_s}s "
                "(chunk_deadline_s)"
            )
        if self.access.board.word(self.ticket.lease_slot) != self._word:
            raise PullFailed(
                f"the lease of request {self.ticket.request_id!r} ended during the read (expired, "
                "or released): the pages read may have been reused"
            )
        return self._end(True, "")

    def _fail(self, reason: str) -> TransferResult:
        log.warning("direct read of %s failed: %s", self.ticket.request_id, reason)
        self._fence_unfinished_copy()
        return self._end(False, reason)

    def _end(self, ok: bool, error: str) -> TransferResult:
        elapsed = time.perf_counter() - self._start
        nbytes = self.plan.total_bytes if (ok and self.plan is not None) else 0
        if self._word:  # the lease was live when we looked: tell P it may release it now
            done = ReadDone(
                self.ticket.request_id,
                self.ticket.lease_gen,
                ok,
                error,
                nbytes,
                int(elapsed * 1e6),
                self.access.data_path,
            )
            try:
                self.r.runtime.submit(self._send(done))
            except RuntimeError as e:  # the transceiver is closing: the lease expires instead
                log.info("ReadDone for %s not sent: %s", done.request_id, e)
        stats = TransferStats(
            self.ticket.request_id,
            "recv",
            nbytes,
            1 if self.plan is not None else 0,
            elapsed,
            ok,
            error,
            self.access.data_path,
        )
        self.r.book.record(stats, chunks=1 if ok else 0)
        return TransferResult(self.ticket.request_id, ok, error, stats)

    async def _send(self, done: ReadDone) -> None:
        try:
            await self.link.send(done, self.r.config.done_deadline_s)
        except (ConnectionError, asyncio.TimeoutError) as e:
            log.info(
                "ReadDone for %s not sent (%s): P releases the pages at lease expiry",
                done.request_id,
                e,
            )
