"""PullSession: the decode side of one pull, from the ticket to the final notice.

    link to P (connect_deadline_s) -> the ticket's checks (compatibility hash, page counts,
    declared history == expected) -> the pages mapped -> the link's data path fetches them
    (paths/) -> the caller's result -> the final notice to P (TransferAck), which frees P's pages.

A failure anywhere is a failed TransferResult, never an exception; P learns of it from the notice
(unless P refused the pull itself), and the data path returns only once nothing of the pull can
still write D's pages. KV is never trimmed or padded to fit: any mismatch fails the pull.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from transfer.faults import D_POINTS, injected
from transfer.link import Link
from transfer.mapper import MapperError, Segment, map_pages
from transfer.messages import Message, PullError, Reject, TransferAck, TransferTicket
from transfer.paths.base import PullFailed
from transfer.stats import TransferResult, TransferStats
from transfer.tp_mapper import map_heads

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class PullSession:
    def __init__(
        self,
        receiver: KVReceiver,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: Mapping[str, int],
        expected_prompt_len: int,
        heads: tuple[int, int] | None = None,
    ) -> None:
        self.r = receiver
        self.heads = heads
        self.config = receiver.config
        self.ticket = ticket
        self.dst = {g: list(ids) for g, ids in dst_page_ids.items()}
        self.skip = dict(skip_pages)
        self.expected = expected_prompt_len
        self.pull_id = random.getrandbits(63)
        self.link: Link | None = None
        self.segments: list[Segment] = []
        self.chunks = 0  # what the data path moved the pages in
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.failing = False  # from a failure or a cancel on, nothing more is written to our pages
        self.refused = False  # P answered PullError: P has dealt with its lease itself
        self.notified = False  # the final notice went to P
        point = receiver.faults.point(ticket.request_id)
        self.fault = point if point in D_POINTS else None

    # ---- for the data paths and the receiver ----
    def deliver(self, msg: Message) -> None:
        self.events.put_nowait(("msg", msg))

    def cancel(self) -> None:
        """The caller gave up: the pull fails at its next step (loop thread)."""
        self.failing = True
        self.events.put_nowait(("cancelled", None))

    def _on_closed(self, reason: str) -> None:
        self.events.put_nowait(("closed", reason))

    async def send(self, msg: Message) -> None:
        assert self.link is not None
        await self.link.send(msg, self.config.pull_deadline_s)

    def notify(self, ok: bool, error: str) -> None:
        """The final notice to P: it frees the pages (once; nothing if P refused the pull)."""
        if self.notified or self.refused or self.link is None or self.link.closed:
            return
        self.notified = True
        t = self.ticket
        ack = TransferAck(t.request_id, self.pull_id, t.lease_gen, ok, error)
        self.link.post(ack, self.config.ack_deadline_s)

    async def next_event(self, timeout: float, what: str) -> tuple[str, Any]:
        """The next event of this pull; raises PullFailed for a failure, a timeout or a cancel."""
        try:
            async with asyncio.timeout(timeout):
                kind, value = await self.events.get()
        except TimeoutError:
            raise PullFailed(f"timed out after {timeout}s waiting for {what}") from None
        if kind == "cancelled":
            raise PullFailed("the pull was cancelled")
        if kind == "closed":
            raise PullFailed(f"link to the prefill worker closed: {value}")
        if isinstance(value, PullError):
            self.refused = True
            raise PullFailed(f"prefill worker refused the pull ({value.code}): {value.reason}")
        if isinstance(value, Reject):
            raise PullFailed(f"protocol error: {value.reason}")
        return kind, value

    def inject(self, point: str) -> None:
        """Fail here if the fault injector chose this pull and this point."""
        if self.fault == point:
            self.r.book.bump("injected_faults")
            raise PullFailed(injected(point))

    def check_declared(self, declared: int) -> None:
        if declared != self.expected:
            raise PullFailed(
                f"declared history mismatch: P declares {declared} prompt tokens, expected "
                f"{self.expected}"
            )

    # ---- the pull ----
    async def run(self) -> TransferResult:
        start, rid = time.perf_counter(), self.ticket.request_id
        try:
            self.inject("connect")
            self.link = await self.r.link_for(self.ticket)
            self.segments = self._map()
            self.check_declared(self.ticket.declared_prompt_len)
            self.r.sessions[self.pull_id] = self
            self.link.add_close_listener(self._on_closed)
            nbytes = await self.link.path.fetch(self)
            self.inject("before_ack")
            result = self._result(start, True, "", nbytes)
            self.notify(True, "")
            return result
        except PullFailed as e:
            error = str(e)
        except Exception as e:  # a bug, or a device error: still tell P
            log.exception("pull of %s failed unexpectedly", rid)
            error = f"internal error: {e!r}"
        finally:
            self.r.sessions.pop(self.pull_id, None)
            if self.link is not None:
                self.link.remove_close_listener(self._on_closed)
        self.failing = True
        self.notify(False, error)
        log.info("pull of %s failed: %s", rid, error)
        return self._result(start, False, error, 0)

    def _map(self) -> list[Segment]:
        """The ticket's pages past ``skip`` mapped onto ours; raises PullFailed."""
        assert self.link is not None
        t, own = self.ticket, self.r.page_table
        if t.compat_hash != own.compat_hash:
            raise PullFailed(
                f"compatibility hash mismatch: the ticket's prefill worker has {t.compat_hash}, "
                f"we have {own.compat_hash}"
            )
        if sorted(self.dst) != sorted(t.page_ids) or sorted(self.skip) != sorted(t.page_ids):
            raise PullFailed(
                f"destination pools {sorted(self.dst)} differ from the ticket's {sorted(t.page_ids)}"
            )
        src = {}
        for g, ids in t.page_ids.items():
            skip = self.skip[g]
            if not 0 <= skip <= len(ids) or len(self.dst[g]) != len(ids) - skip:
                raise PullFailed(
                    f"pool {g!r}: the ticket has {len(ids)} pages, skip_pages={skip}, so "
                    f"{len(ids) - skip} destination pages are needed, got {len(self.dst[g])}"
                )
            src[g] = ids[skip:]
        try:
            if self.heads is not None:
                return map_heads(self.link.peer_table, own, src, self.dst, *self.heads)
            return map_pages(self.link.peer_table, own, src, self.dst)
        except MapperError as e:
            raise PullFailed(f"cannot map the pages: {e}") from None

    def _result(self, start: float, ok: bool, error: str, nbytes: int) -> TransferResult:
        path = self.link.path.name if self.link is not None else "ucx"
        stats = TransferStats(
            self.ticket.request_id,
            "recv",
            nbytes,
            self.chunks,
            time.perf_counter() - start,
            ok,
            error,
            path,
        )
        self.r.book.record(stats)
        return TransferResult(self.ticket.request_id, ok, error, stats)
