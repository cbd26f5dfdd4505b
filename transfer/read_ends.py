"""ReadEnds: the prefill side's view of how direct reads end (direct_read.py), and the lease
releases that follow: ReadDone messages, and the records of decode workers' done boards
(done_board.py), which it polls on the loop thread while leases are live.

While a lease is live and a decode worker with a done board is linked, P's loop wakes every
``POLL_S`` and reads one word per such link (a few microseconds of the GIL); that saves every direct
read a wake-up of D's event loop and a message (docs/benchmarks/transfer.md). Otherwise it wakes
every ``IDLE_POLL_S``, so a lease published meanwhile is released at most that much later; leases
last seconds.
"""

from __future__ import annotations

import asyncio
import logging

from transfer.done_board import DoneBoardView
from transfer.leases import LeaseTable
from transfer.messages import ReadDone
from transfer.peer import PeerLink
from transfer.stats import StatsBook, TransferStats

log = logging.getLogger(__name__)

POLL_S = 0.001
IDLE_POLL_S = 0.05


class ReadEnds:
    """Loop thread only."""

    def __init__(self, leases: LeaseTable, book: StatsBook) -> None:
        self.leases = leases
        self.book = book
        self._links: set[PeerLink] = set()

    def add_link(self, link: PeerLink) -> None:
        """Read ``link``'s done board (if the handshake opened one) until the link closes."""
        if link.done is None:
            return
        self._links.add(link)
        # What D wrote before the link went is still honoured.
        link.add_close_listener(
            lambda reason: self._drop(link, not reason.startswith("reading its done board failed"))
        )

    def _drop(self, link: PeerLink, drain: bool) -> None:
        """Stop reading ``link``'s board (after a last drain, if ``drain``)."""
        self._links.discard(link)
        board, link.done = link.done, None
        if board is None:
            return
        try:
            if drain:
                self._drain(link.name, board)
        finally:
            board.close()

    async def run(self) -> None:
        while True:
            busy = self._links and len(self.leases)
            await asyncio.sleep(POLL_S if busy else IDLE_POLL_S)
            for link in list(self._links):
                board = link.done
                if board is None:
                    continue
                try:
                    if board.ended:  # D fell back to UCX, or is leaving: a last drain, then no more
                        self._drop(link, drain=True)
                    else:
                        self._drain(link.name, board)
                except Exception as e:  # a bug: that link's reads would only ever expire
                    log.exception("%s: reading its done board failed", link.name)
                    link.abort(f"reading its done board failed: {e}")  # D connects anew

    def _drain(self, name: str, board: DoneBoardView) -> None:
        records, lost = board.drain()
        if lost:
            log.warning("%s: %d done-board records were overwritten unread", name, lost)
        for slot, gen, nbytes, micros, path in records:
            lease = self.leases.by_slot(slot)
            if lease is None:
                log.info("late done-board record for slot %d dropped: its lease ended", slot)
                continue
            self.finished(lease.request_id, gen, True, "", nbytes, micros, path)  # checks gen

    def on_read_done(self, msg: ReadDone) -> None:
        self.finished(
            msg.request_id, msg.lease_gen, msg.ok, msg.error, msg.total_bytes, msg.micros,
            msg.data_path,
        )  # fmt: skip

    def finished(
        self, rid: str, gen: int, ok: bool, error: str, nbytes: int, micros: int, path: str
    ) -> None:
        """A decode worker read lease ``gen`` of ``rid`` itself, or gave up: release it."""
        how = "read directly" if ok else f"decode side failed the transfer: {error}"
        if not self.leases.end_direct(rid, gen, how):  # (checked and ended under one lock)
            log.info("late end of a direct read of %s dropped: its lease already ended", rid)
            return
        self.book.record(
            TransferStats(rid, "send", nbytes if ok else 0, 1, micros / 1e6, ok, error, path)
        )
