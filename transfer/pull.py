"""PullSession: the decode side of one pull, from the ticket to the ack.

    connect (connect_deadline_s) -> early checks -> post receives for the first chunks ->
    PullRequest with those credits -> first chunk or P's answer (pull_deadline_s) -> more credits
    (ChunkReady) as staging buffers free up -> chunks (chunk_deadline_s between two) and
    TransferDone (done_deadline_s after the last chunk) -> check every chunk arrived and the
    declared prompt length == expected -> the caller's result (``on_result``) -> ack.

Receives posted for a pull that fails must end before the pages may be reused: P completes those
it will not send with empty messages when it refuses or gives up cleanly (PullError.drained; also
when D gave up first, on D's negative ack); otherwise the link is aborted, the only way UCX cancels
a receive (other pulls on that link fail too; the next pull reconnects). ``run`` returns only
after every receive and page copy of this pull has ended, and so does a cancelled ``pull``
(receiver.py; ``quiet``). KV is never trimmed or padded: any mismatch fails the pull.

On a direct link (D opened P's pools, ipc.py) a ticket with a lease board slot is read by D itself
instead (direct_read.py); this session then only connects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transfer.copy_wait import outlast_cancels
from transfer.deadline import next_item
from transfer.mapper import MapperError
from transfer.messages import (
    ChunkReady,
    PullError,
    PullRequest,
    Reject,
    TransferAck,
    TransferDone,
    TransferTicket,
    data_tag,
)
from transfer.peer import PeerLink
from transfer.plan import Chunk, TransferPlan, build_plan
from transfer.pull_checks import PullFailed, check_declared, source_pages
from transfer.serve import settle
from transfer.staging import pool_region, scatter_chunk
from transfer.stats import TransferResult, TransferStats
from transfer.ucp_iov import chunk_pieces

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class PullSession:
    def __init__(
        self,
        receiver: KVReceiver,
        ticket: TransferTicket,
        dst_page_ids: dict[str, list[int]],
        skip_pages: int,
        expected_prompt_len: int,
        pull_id: int,
    ) -> None:
        self.r = receiver
        self.ticket = ticket
        self.dst = dst_page_ids
        self.skip = skip_pages
        self.expected = expected_prompt_len
        self.pull_id = pull_id
        self.link: PeerLink | None = None
        self.plan: TransferPlan | None = None
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._recvs: list[asyncio.Task] = []
        self._feeder: asyncio.Task | None = None
        self._credits: list[int] = []  # posted, not yet announced to P
        self._refusal: PullError | None = None
        self._rejected = False  # P rejected a message of ours: it will not answer a negative ack
        self._failed = False
        self._cancelled = False
        self._reading = False  # this session runs a direct read
        self.connecting = False  # waiting for the link to P (nothing posted, nothing to undo)
        self.outcome: TransferResult | None = None  # the result, once the pull ended cancelled
        self._booked = False  # its stats recorded
        # Done once nothing of this pull can write the caller's pages any more: when ``run``
        # ends, or at a cancel that came before any receive was posted (any thread may wait).
        self.quiet: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._on_closed = lambda reason: self.events.put_nowait(("closed", reason))
        # Given a success before the ack goes (loop thread); ``run`` returns it after the ack.
        self.on_result: Callable[[TransferResult], None] = lambda result: None

    def deliver(self, msg: PullError | TransferDone | Reject) -> None:
        self.events.put_nowait(("msg", msg))

    def cancel(self) -> None:
        """The caller gave up (loop thread): the pull fails at its next step, ending its receives
        as any failure does. Before any receive is posted (connecting, say) nothing can write the
        caller's pages, so the pull is quiet at once: the check before the first receive and this
        run on the same thread."""
        self._cancelled = True
        self.events.put_nowait(("cancelled", None))
        if not self._recvs and not self._reading and (self._feeder is None or self._feeder.done()):
            self._quiet()

    def _quiet(self) -> None:
        if not self.quiet.done():
            self.quiet.set_result(None)

    async def run(self) -> TransferResult:
        start, rid = time.perf_counter(), self.ticket.request_id
        try:
            src = source_pages(self.ticket, self.r.page_table, self.dst, self.skip)
            self.connecting = True
            try:
                self.link = await self.r.links.link_for(self.ticket)
            finally:
                self.connecting = False
            # ``cancel`` may have called the pull quiet while we connected: start nothing now.
            # (No await from here to the first receive: a later cancel sees it posted.)
            if self._cancelled:
                raise PullFailed("the pull was cancelled")  # (the negative ack frees P's pages)
            read = self.r.direct_read(self.link, self.ticket, self.dst, self.skip, self.expected)
            if read is not None:
                self.link = None  # nothing of this session's to clean up on the link
                self._reading = True
                with self.r.counting_read():  # (not in ``sessions``: count it as a read)
                    return await read.run()
            self.link.add_close_listener(self._on_closed)
            self.r.sessions[self.pull_id] = self
            check_declared(self.ticket.declared_prompt_len, self.expected)
            try:
                self.plan = build_plan(
                    self.link.info.page_table,
                    self.r.page_table,
                    src,
                    self.dst,
                    self.link.info.pull_chunk_bytes,
                )
            except (MapperError, ValueError) as e:
                raise PullFailed(f"cannot map the pages: {e}") from None
            await self._transfer()
            # Every byte is in place and checked: the caller has its result before the ack, which
            # only frees P's pages (docs/benchmarks/transfer.md, eighteenth pass).
            result = self._result(start, ok=True)
            self._quiet()
            self.on_result(result)
            ack = TransferAck(rid, self.pull_id, True, "", self.ticket.lease_gen)
            try:  # (a lost ack: P's lease expires and frees its pages all the same)
                await self.link.send(ack, self.r.config.done_deadline_s)
            except ConnectionError as e:
                log.info("ack of %s not sent: %s", rid, e)
            return result
        except PullFailed as e:
            return await self._failed_with(start, str(e))
        except ConnectionError as e:
            return await self._failed_with(start, f"connection to the prefill worker failed: {e}")
        except Exception as e:  # a bug, or a device error: end the receives and tell P all the same
            log.exception("pull of %s failed unexpectedly", rid)
            return await self._failed_with(start, f"internal error: {e!r}")
        except asyncio.CancelledError:  # our task itself was cancelled: clean up all the same
            why = "the receiver closed" if self.r.closed else "the pull was cancelled"
            await outlast_cancels(asyncio.ensure_future(self._clean_up(why)))
            self.outcome = self._result(start, ok=False, error=why)
            raise
        finally:
            self.r.sessions.pop(self.pull_id, None)
            if self.link is not None:
                self.link.remove_close_listener(self._on_closed)
            self._quiet()

    async def _failed_with(self, start: float, error: str) -> TransferResult:
        """Clean up after a failure, then the failed result. The clean-up outlasts cancels (a
        ``close`` that gave up waiting cancels us): what it waits for may still write the caller's
        pages, which are the caller's again once we return. (A CancelledError raised in an
        ``except`` handler would skip ``run``'s own CancelledError clause.)"""
        await outlast_cancels(asyncio.ensure_future(self._clean_up(error)))
        return self._result(start, ok=False, error=error)

    def ended_by_close(self) -> TransferResult:
        """The result of a pull ``KVReceiver.close`` cancelled (once it is quiet)."""
        if self.outcome is None:  # cancelled before it ran
            self.outcome = self._result(time.perf_counter(), ok=False, error="the receiver closed")
        return self.outcome

    def _pull_request(self, ready: list[int]) -> PullRequest:
        assert self.link is not None and self.plan is not None
        return PullRequest(
            self.ticket.request_id,
            self.pull_id,
            self.ticket.page_ids,
            self.dst,
            self.skip,
            self.plan.chunk_bytes,
            self.plan.num_chunks,
            self.plan.total_bytes,
            ready,
            self.ticket.lease_gen,
        )

    async def _transfer(self) -> None:
        assert self.link is not None and self.plan is not None
        cfg, plan = self.r.config, self.plan
        if self.r.late_copies.pending() and any(
            self.r.moves_straight(c, source=False) for c in plan.chunks
        ):
            # UCX would write pool memory unordered with a late direct copy into those pages.
            self.r.book.bump("late_copy_waits")
            if not await self.r.late_copies.wait(cfg.chunk_deadline_s, lambda: self._cancelled):
                raise PullFailed(
                    "a page copy of an earlier pull that outlived its deadline still writes our "
                    f"pages after {cfg.chunk_deadline_s}s (chunk_deadline_s)"
                )
            # A cancel meanwhile found nothing posted and handed the pages back: post nothing.
            # (No await from here to the first receive, as in ``run``.)
            if self._cancelled:
                raise PullFailed("the pull was cancelled")
        # Every receive straight into the pool is posted now (they need no buffer), then staged ones
        # while buffers last; the feeder credits the rest in plan order as buffers free up.
        pending = [
            c for c in plan.chunks if not (self.r.moves_straight(c, source=False) and self._post(c))
        ]
        while pending and self._post(pending[0]):
            pending.pop(0)
        ready, self._credits = self._credits, []
        await self.link.send(self._pull_request(ready), cfg.pull_deadline_s)
        if pending:
            self._feeder = asyncio.ensure_future(self._feed(pending))
        done: TransferDone | None = None
        arrived = 0
        while arrived < plan.num_chunks or done is None:
            if arrived == 0:
                what, timeout = (
                    "the first chunk or P's answer to the pull request",
                    cfg.pull_deadline_s,
                )
            elif arrived < plan.num_chunks:
                what, timeout = f"chunk {arrived + 1}/{plan.num_chunks}", cfg.chunk_deadline_s
            else:
                what, timeout = "TransferDone after the last chunk", cfg.done_deadline_s
            event = await self._next(what, timeout)
            if isinstance(event, TransferDone):
                done = event
            elif event == "chunk":
                arrived += 1
                self.r.book.bump("chunks")  # (direct reads count theirs on other threads)
            else:
                raise PullFailed(f"unexpected {type(event).__name__} during the transfer")
        self._check_done(done, arrived)

    def _check_done(self, done: TransferDone, arrived: int) -> None:
        assert self.plan is not None
        if (done.num_chunks, done.total_bytes) != (arrived, self.plan.total_bytes):
            raise PullFailed(
                f"incomplete transfer: P sent {done.num_chunks} chunks / {done.total_bytes} bytes, "
                f"we expected {self.plan.num_chunks} / {self.plan.total_bytes} and got {arrived} chunks"
            )
        if done.declared_prompt_len != self.expected:
            raise PullFailed(
                f"declared history mismatch: P declares {done.declared_prompt_len} prompt tokens, "
                f"expected {self.expected}"
            )

    async def _next(self, what: str, timeout: float) -> Any:
        """The next event: "chunk", or a message from P; raises PullFailed for failures."""
        try:
            kind, value = await next_item(self.events, timeout)
        except asyncio.TimeoutError:
            raise PullFailed(f"timed out after {timeout}s waiting for {what}") from None
        if kind == "cancelled":
            raise PullFailed("the pull was cancelled")
        if kind == "closed":
            raise PullFailed(f"link to the prefill worker closed: {value}")
        if kind == "recv_failed":
            raise PullFailed(f"receiving chunk {value[0]} failed: {value[1]}")
        if isinstance(value, PullError):
            self._refusal = value
            raise PullFailed(f"prefill worker refused the pull ({value.code}): {value.reason}")
        if isinstance(value, Reject):
            self._rejected = True
            raise PullFailed(f"protocol error: {value.reason}")
        return value

    def _post(self, chunk: Chunk, buf: Any = None) -> bool:
        """Post the receive of ``chunk`` (into the pool, or a staging buffer: ``buf`` or a free
        one); False if it needs a staging buffer and none is free."""
        if buf is None and not self.r.moves_straight(chunk, source=False):
            buf = self.r.staging.try_acquire()
            if buf is None:
                return False
        self._recvs.append(asyncio.ensure_future(self._receive(chunk, buf)))
        self._credits.append(chunk.index)
        return True

    async def _feed(self, pending: list[Chunk]) -> None:
        """Post the remaining receives as staging buffers free up, and send the credits."""
        for chunk in pending:
            if not self._post(chunk):
                await self._credit()  # announce what is posted before waiting for a buffer
                self._post(chunk, buf=await self.r.staging.acquire())
        await self._credit()

    async def _credit(self) -> None:
        if self._credits and self.link is not None:
            chunks, self._credits = self._credits, []
            await self.link.send(
                ChunkReady(self.ticket.request_id, self.pull_id, chunks),
                self.r.config.chunk_deadline_s,
            )

    async def _receive(self, chunk: Chunk, buf: Any) -> None:
        assert self.link is not None
        tag = data_tag(self.pull_id, chunk.index)
        try:
            if buf is None and chunk.dst_run is not None and self.r.iov is None:
                pool, offset = chunk.dst_run
                await self.link.recv_data(pool_region(self.r.rows[pool], offset, chunk.nbytes), tag)
            elif buf is None:  # host pages in one message (moves_straight; a run as plain bytes)
                pieces = chunk_pieces(chunk, self.r.rows, False)
                await self.link.recv_pieces(self.r.iov, pieces, tag)
            else:
                staged = buf[: chunk.nbytes]
                await self.link.recv_data(staged, tag)
                if not self._failed:  # (a drained, empty receive of a failed pull: no copy)
                    await self.r.runtime.copy(scatter_chunk, chunk, staged, self.r.rows)
            self.events.put_nowait(("chunk", "chunk"))
        except Exception as e:
            self.events.put_nowait(("recv_failed", (chunk.index, e)))
        finally:
            if buf is not None:
                self.r.staging.release(buf)

    async def _clean_up(self, reason: str) -> None:
        """After a failure: end every receive of this pull, and tell P (if it can still hear)."""
        self._failed = True
        if self._feeder is not None and not self._feeder.done():
            self._feeder.cancel()  # it only waits for buffers or sends credits: safe to cancel
            await settle([self._feeder], self.r.config.chunk_deadline_s)
        link, rid, cfg = self.link, self.ticket.request_id, self.r.config
        # P refused the pull or failed it (PullError): it has ended its side, and a negative ack
        # would only find the request's lease by its id, which may be a newer publish of it by
        # then (the worker's router gives the pages of a failed request back).
        if link is not None and not link.closed and self._refusal is None:
            try:  # first, so P frees its pages now rather than at lease expiry
                ack = TransferAck(rid, self.pull_id, False, reason, self.ticket.lease_gen)
                await link.send(ack, cfg.done_deadline_s)
            except ConnectionError:
                pass
            if not self._rejected:
                await self._await_answer(cfg.chunk_deadline_s)
        if self._refusal is not None and self._refusal.drained:
            await settle(self._recvs, cfg.chunk_deadline_s)  # P is completing them
        if any(not t.done() for t in self._recvs) and link is not None:
            link.abort(f"pull of {rid} failed with receives posted: {reason}")
        # An aborted receive ends at once, but its page copy may wait for the copy thread, and
        # the pages are the caller's once we return: wait long before giving up on it.
        if not await settle(self._recvs, 4 * cfg.chunk_deadline_s):
            log.error("receives of %s did not end after the link was aborted", rid)
        log.warning("pull of %s failed: %s", rid, reason)

    async def _await_answer(self, timeout: float) -> None:
        """After our negative ack, while receives are posted: P fails the pull it serves on that
        ack, completes the receives of chunks it never started and says so (PullError), or aborts
        the link if sends were in flight. Waiting for that (up to ``timeout``) rather than
        aborting the link at once keeps the other pulls on the link alive when one fails on our
        side (a cancel, a check)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(not t.done() for t in self._recvs):
            try:
                kind, value = await next_item(self.events, deadline - loop.time())
            except asyncio.TimeoutError:
                return
            if kind == "closed":
                return
            if kind == "msg" and isinstance(value, PullError):
                self._refusal = value
                return

    def _result(self, start: float, ok: bool, error: str = "") -> TransferResult:
        """The pull's result, booked once (``close`` may answer for a pull before it ends)."""
        plan = self.plan
        stats = TransferStats(
            self.ticket.request_id,
            "recv",
            plan.total_bytes if (ok and plan) else 0,
            plan.num_chunks if plan else 0,
            time.perf_counter() - start,
            ok,
            error,
            "ucx",
        )
        if not self._booked:
            self._booked = True
            self.r.book.record(stats)
        return TransferResult(self.ticket.request_id, ok, error, stats)
