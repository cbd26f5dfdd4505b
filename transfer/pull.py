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
from transfer.mapper import MapperError, Segment, map_pages, source_bytes
from transfer.messages import Message, PullError, Reject, TransferAck, TransferTicket
from transfer.paths.base import PullFailed
from transfer.stats import TransferResult, TransferStats
from transfer.tp_mapper import head_source_bytes, map_heads

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)

# A success notice waits this long, so that the caller has the result before the write wakes P:
# same run, paired, notice at once / after the caller: 1 MiB 1.04 (host_shm and ucx), 16 MiB
# 1.09 [1.02-1.14] host_shm and 1.04 ucx (25 repetitions, load 8; docs/benchmarks/transfer.md).
ACK_DELAY_S = 0.0005


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
        # Pages D holds or does not need, per group, counted in the ticket's list (the caller
        # counts them from the request's first page: check_ticket converts).
        self.wanted_from = dict(skip_pages)
        self.skip: dict[str, int] = {}
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

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

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
        """The final notice to P: it frees the pages (once; nothing if P refused the pull). A
        success is written ACK_DELAY_S later, once our caller went on with the result: writing
        wakes P, which on a busy host runs in the writer's place for a while. A failure goes at
        once (over UCX, P stops sending on it)."""
        if self.notified or self.refused or self.link is None or self.link.closed:
            return
        self.notified = True
        t = self.ticket
        ack = TransferAck(t.request_id, self.pull_id, t.lease_gen, ok, error)
        if ok:
            asyncio.get_running_loop().call_later(
                ACK_DELAY_S, self.link.post, ack, self.config.ack_deadline_s
            )
        else:
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
            self.check_ticket()
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

    def source_pages(self) -> dict[str, list[int]]:
        """The ticket's pages past ``skip``: the ones this pull moves."""
        return {g: ids[self.skip[g] :] for g, ids in self.ticket.page_ids.items()}

    def source_bytes(self) -> int:
        """The bytes this pull moves, counted without mapping (what a direct read declares)."""
        assert self.link is not None
        if self.heads is not None:
            return head_source_bytes(self.link.peer_table, self.source_pages(), self.heads[1])
        return source_bytes(self.link.peer_table, self.source_pages())

    def map(self) -> list[Segment]:
        """The pull's pages mapped onto ours (kept in ``segments``): whole pages, or with
        ``heads`` only those KV heads of each page (transfer/tp_mapper.py); raises PullFailed."""
        assert self.link is not None
        peer, own, src = self.link.peer_table, self.r.page_table, self.source_pages()
        try:
            if self.heads is not None:
                self.segments = map_heads(peer, own, src, self.dst, *self.heads)
            else:
                self.segments = map_pages(peer, own, src, self.dst)
        except MapperError as e:
            raise PullFailed(f"cannot map the pages: {e}") from None
        return self.segments

    def check_ticket(self) -> None:
        """The ticket against us and the pages we give (no mapping yet); raises PullFailed."""
        t, own = self.ticket, self.r.page_table
        if t.compat_hash != own.compat_hash:
            raise PullFailed(
                f"compatibility hash mismatch: the ticket's prefill worker has {t.compat_hash}, "
                f"we have {own.compat_hash}"
            )
        groups = sorted(t.page_ids)
        if (
            sorted(t.first_page) != groups
            or sorted(self.dst) != groups
            or sorted(self.wanted_from) != groups
        ):
            raise PullFailed(
                f"destination pools {sorted(self.dst)} differ from the ticket's {sorted(t.page_ids)}"
            )
        for g, ids in t.page_ids.items():
            first = t.first_page[g]
            skip = self.skip[g] = self.wanted_from[g] - first
            if skip < 0:
                raise PullFailed(
                    f"pool {g!r}: we need the request's pages from {self.wanted_from[g]} on, the "
                    f"prefill worker holds them from {first} on (different windows?)"
                )
            if skip > len(ids) or len(self.dst[g]) != len(ids) - skip:
                raise PullFailed(
                    f"pool {g!r}: the ticket has {len(ids)} pages from page {first}, we need "
                    f"those from page {self.wanted_from[g]}, so {len(ids) - skip} destination "
                    f"pages, got {len(self.dst[g])}"
                )

    def _result(self, start: float, ok: bool, error: str, nbytes: int) -> TransferResult:
        path = self.link.path.name if self.link is not None else None
        stats = TransferStats(
            self.ticket.request_id,
            "recv",
            nbytes,
            self.chunks,
            time.perf_counter() - start,
            ok,
            error,
            path,
            {g: len(ids) for g, ids in self.dst.items()} if ok else {},
        )
        self.r.book.record(stats)
        return TransferResult(self.ticket.request_id, ok, error, stats)
