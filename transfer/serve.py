"""ServeSession: the prefill side of one pull, from PullRequest to the release of the pages.

D grants credits (PullRequest.ready_chunks, then ChunkReady): the chunks it has posted receives for.
P gathers and sends exactly those, so a send never waits for a receive D could not post, and the
staging buffers of the two sides cannot deadlock. Once every chunk's copy or send has begun P sends
TransferDone (it travels while the last bytes do); the pages are released when every send has
completed and D has acked, or at the ack deadline. Every wait is bounded by chunk_deadline_s.

On failure: with sends in flight the link is aborted (UCX cancels them) and the pages are released
only after every send has ended; without, the credited chunks that will never be sent are completed
with empty messages ("drained") so D's receives end without tearing the link down. When D failed
the pull first (its negative ack), D ignores every byte of it: chunks not yet handed to UCX then go
as empty messages, posted sends may finish, and the link stays up. A drained
receive looks like data to D (ucxx does not report a short message), so a chunk is drained only
while TransferDone is unsent: D completes a pull only after TransferDone, and the PullError that
follows the drain fails it instead.

(A decode worker that reads P's pools directly never sends a PullRequest: see direct_read.py.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from transfer.deadline import next_item
from transfer.messages import PullError, PullRequest, TransferDone, data_tag
from transfer.peer import PeerLink
from transfer.plan import Chunk, TransferPlan
from transfer.staging import gather_chunk, pool_region
from transfer.stats import TransferStats
from transfer.ucp_iov import chunk_pieces

if TYPE_CHECKING:
    from transfer.leases import Lease
    from transfer.sender import KVSender

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)


class ServeFailed(Exception):
    pass


DRAIN_IN_FLIGHT = 64  # empty messages in flight at a time: memory stays bounded, whatever D asks
HOST_SENDS_IN_FLIGHT = 2  # staged chunks P sends at once when its KV is in host memory


async def drain(link: PeerLink, pull_id: int, chunks: list[int]) -> None:
    """Complete D's receives for ``chunks`` with empty messages (nothing is written), each chunk
    once however often D named it."""
    chunks = sorted(set(chunks))
    for start in range(0, len(chunks), DRAIN_IN_FLIGHT):
        part = chunks[start : start + DRAIN_IN_FLIGHT]
        await asyncio.gather(*(link.send_data(_EMPTY, data_tag(pull_id, i)) for i in part))


class ServeSession:
    def __init__(
        self,
        sender: KVSender,
        link: PeerLink,
        req: PullRequest,
        plan: TransferPlan,
        lease: Lease,
    ) -> None:
        self.sender = sender
        self.link = link
        self.req = req
        self.plan = plan
        self.serving = True  # until every send has ended; acks go to the session meanwhile
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task] = {}
        self._io_started: set[int] = set()  # chunks whose copy/send began (not cancellable)
        self._acked: tuple[bool, str] | None = None
        self._failing = False  # credits from now on are completed empty at once
        # D failed the pull first (its negative ack): D ignores every byte of it from then on,
        # so a chunk whose send is not posted yet goes as an empty message instead.
        self._d_gave_up = False
        # On CPU (TCP) at most two sends at a time, in credit order: the next chunk's rendezvous
        # overlaps the bytes of the one before it (0.71-0.84 -> 0.83-0.92 of raw ucxx at 64-256
        # MiB of scattered pages on 16 cores; docs/benchmarks/transfer.md, fifteenth pass), but
        # all at once would share the wire and end together, so D's scatters would run after the
        # last byte instead of under the next chunk. Between GPUs (cuda_ipc) concurrent messages
        # overlap their rendezvous latency.
        self._send_slot = asyncio.Semaphore(
            self.plan.num_chunks if sender.rows_on_gpu else HOST_SENDS_IN_FLIGHT
        )
        # D credits at once every chunk it receives straight into its pool, also those P must
        # stage: at most this many of them wait for or hold a staging buffer, so the chunks of
        # other pulls get buffers in between (as when D's own buffers bound its credits).
        self._stage_slots = asyncio.Semaphore(sender.staging.max_buffers)
        # Chunk 0 gathered at publish time (prestage.py), if it is this plan's chunk 0.
        self._prestaged = (
            sender.prestage.take(lease, plan.chunks[0], 0 in req.ready_chunks)
            if plan.chunks
            else None
        )
        self._on_closed = lambda reason: self.events.put_nowait(("closed", reason))

    def credit(self, chunks: list[int]) -> None:
        if self._failing:
            self.sender.drain_late(self.link, self.req.pull_id, self._ungranted(chunks))
        else:
            self.events.put_nowait(("credit", chunks))

    def _ungranted(self, chunks: list[int]) -> list[int]:
        return [i for i in chunks if 0 <= i < self.plan.num_chunks and i not in self._tasks]

    def ack(self, ok: bool, error: str) -> None:
        self.events.put_nowait(("ack", (ok, error)))

    def begin(self) -> None:
        """Start the sends D credited in its PullRequest (``admit`` checked those credits) in the
        loop step that admitted the pull, ahead of ``run``'s first step, which came before them
        (docs/benchmarks/transfer.md, eighteenth pass). Then ``run``."""
        self.link.add_close_listener(self._on_closed)
        self._grant(self.req.ready_chunks)

    async def run(self) -> None:
        cfg, rid = self.sender.config, self.req.request_id
        start = time.perf_counter()
        try:
            await self._serve()
            self._take_queued_acks()
            self.serving = False
            if self._acked is not None:  # D had every byte before our send completions came in
                self.sender.leases.release(rid, "acked", force=True)
            elif not self.sender.leases.await_ack(rid, cfg.ack_deadline_s):
                self.sender.leases.release(rid, "cancelled", force=True)  # while we served it
            self._record(start, ok=True)
        except (ServeFailed, ConnectionError) as e:
            self.serving = False
            await self._fail(str(e), start)
        finally:
            self.link.remove_close_listener(self._on_closed)
            pre, self._prestaged = self._prestaged, None
            if pre is not None:  # chunk 0 was never sent
                self.sender.prestage.give_back(pre)

    async def _serve(self) -> None:
        cfg, n = self.sender.config, self.plan.num_chunks
        sent, done_sent = 0, False
        while True:
            if not done_sent and len(self._io_started) == n:  # nothing left to drain
                declared = self._lease_declared()
                done = TransferDone(
                    self.req.request_id, self.req.pull_id, declared, self.plan.total_bytes, n
                )
                await self.link.send(done, cfg.done_deadline_s)
                done_sent = True
            if sent == n:
                return
            try:
                kind, value = await next_item(self.events, cfg.chunk_deadline_s)
            except asyncio.TimeoutError:
                raise ServeFailed(
                    f"no progress for {cfg.chunk_deadline_s}s (chunk_deadline_s) with {sent}/{n} chunks sent"
                ) from None
            if kind == "credit":
                self._grant(value)
            elif kind == "started":
                pass  # the loop's head sends TransferDone once every chunk has started
            elif kind == "sent":
                sent += 1
                self.sender.book.counters.chunks += 1
                self.sender.leases.renew(self.req.request_id, cfg.lease_s)
            elif kind == "send_failed":
                raise ServeFailed(f"sending chunk {value[0]} failed: {value[1]}")
            elif kind == "ack":
                if not value[0]:
                    self._d_gave_up = True
                    raise ServeFailed(f"decode side gave up: {value[1]}")
                self._acked = value
            elif kind == "closed":
                raise ServeFailed(f"link closed: {value}")

    def _take_queued_acks(self) -> None:
        """An ack that came in while TransferDone was still draining sits in the queue once the
        serving loop has returned: take it, or P would wait for it until the ack deadline."""
        while not self.events.empty():
            kind, value = self.events.get_nowait()
            if kind == "ack":
                if not value[0]:
                    raise ServeFailed(f"decode side gave up: {value[1]}")
                self._acked = value

    def _grant(self, chunks: list[int]) -> None:
        for i in chunks:
            if not 0 <= i < self.plan.num_chunks or i in self._tasks:
                raise ServeFailed(
                    f"invalid credit for chunk {i} (plan has {self.plan.num_chunks} chunks)"
                )
            self._tasks[i] = asyncio.ensure_future(self._send_chunk(self.plan.chunks[i]))
        self.sender.leases.renew(self.req.request_id, self.sender.config.lease_s)

    async def _send_chunk(self, chunk: Chunk) -> None:
        s, tag = self.sender, data_tag(self.req.pull_id, chunk.index)
        try:
            lists = self._lists_pages()
            if chunk.sends_straight(s.config.zero_copy, s.staging.buffer_bytes) and not lists:
                pool, offset = chunk.src_run  # type: ignore[misc]  (sends_straight: one run)
                self._started(chunk.index)
                async with self._send_slot:
                    await self.link.send_data(
                        self._payload(pool_region(s.rows[pool], offset, chunk.nbytes)), tag
                    )
            elif lists:  # (a run too: one piece goes as plain bytes, ucp_iov)
                await self._send_pieces(chunk, tag)
            else:
                # (the slot's wait and the buffer's: the only cancellable waits of this task)
                async with self._stage_slots:
                    staged = not self._lists_pages()  # (the link may have become able meanwhile)
                    if staged:
                        await self._send_staged(chunk, tag)
                if not staged:
                    await self._send_pieces(chunk, tag)
            self.events.put_nowait(("sent", chunk.index))
        except Exception as e:
            self.events.put_nowait(("send_failed", (chunk.index, e)))

    def _lists_pages(self) -> bool:
        """Whether scattered host pages go as a piece list now (``KVSender.iov``, and the link's
        endpoint able to: ``PeerLink.piece_sends_ok``), rather than staged."""
        return self.sender.iov is not None and self.link.piece_sends_ok

    async def _send_pieces(self, chunk: Chunk, tag: int) -> None:
        self._started(chunk.index)
        async with self._send_slot:
            if self._d_gave_up:
                await self.link.send_data(_EMPTY, tag)
            else:
                pieces = chunk_pieces(chunk, self.sender.rows, True)
                await self.link.send_pieces(self.sender.iov, pieces, tag)

    async def _send_staged(self, chunk: Chunk, tag: int) -> None:
        s, pre = self.sender, None
        if chunk.index == 0:
            pre, self._prestaged = self._prestaged, None
        buf = pre.buf if pre is not None else await s.staging.acquire()
        self._started(chunk.index)
        try:
            staged = buf[: chunk.nbytes]
            if pre is None or not await pre.ready():
                await s.runtime.copy(gather_chunk, chunk, s.rows, staged)
            else:
                s.book.counters.prestaged_chunks += 1
            async with self._send_slot:
                await self.link.send_data(self._payload(staged), tag)
        finally:
            if pre is not None:
                s.prestage.give_back(pre)
            else:
                s.staging.release(buf)

    def _payload(self, data: torch.Tensor) -> torch.Tensor:
        """What a chunk's send carries: its bytes, or nothing once D has given up (see
        ``_d_gave_up``; D's receive must still end)."""
        return _EMPTY if self._d_gave_up else data

    def _started(self, index: int) -> None:
        """From here on chunk ``index`` is never drained (nor its task cancelled)."""
        self._io_started.add(index)
        self.events.put_nowait(("started", index))

    async def _fail(self, reason: str, start: float) -> None:
        rid, cfg = self.req.request_id, self.sender.config
        self._failing = True
        unsent = [i for i, t in self._tasks.items() if not t.done() and i not in self._io_started]
        for i in unsent:
            self._tasks[i].cancel()
        while not self.events.empty():  # credits that came in but were not granted yet
            kind, value = self.events.get_nowait()
            if kind == "credit":
                unsent += self._ungranted(value)
        in_flight = [i for i, t in self._tasks.items() if not t.done() and i in self._io_started]
        if self.link.closed or (in_flight and not self._d_gave_up):
            # The only way to stop UCX reading the pages / staging buffers: cancel its requests.
            self.link.abort(f"serving {rid} failed: {reason}")
        settled = await settle(list(self._tasks.values()), cfg.chunk_deadline_s)
        if not settled and not self.link.closed:  # D gave up, but a send did not end
            self.link.abort(f"serving {rid} failed: {reason}; a send did not end")
            settled = await settle(list(self._tasks.values()), cfg.chunk_deadline_s)
        if settled:
            self.sender.leases.release(rid, f"failed: {reason}", force=True)
        else:
            log.error(
                "sends of %s did not end after the link was aborted; its pages stay pinned", rid
            )
        if not self.link.closed:
            try:
                await asyncio.wait_for(
                    drain(self.link, self.req.pull_id, unsent), cfg.chunk_deadline_s
                )
                await self.link.send(
                    PullError(rid, self.req.pull_id, "failed", reason, True), cfg.done_deadline_s
                )
            except Exception as e:  # ucxx errors are not all ConnectionErrors
                self.link.abort(f"ending the failed pull of {rid} failed: {e!r}")
        log.warning("serving %s failed: %s", rid, reason)
        self._record(start, ok=False, error=reason)

    def _lease_declared(self) -> int:
        lease = self.sender.leases.get(self.req.request_id)
        if lease is None:  # only release() removes a SERVING lease, and only this session calls it
            raise ServeFailed("the lease vanished while serving")
        return lease.declared_prompt_len

    def _record(self, start: float, ok: bool, error: str = "") -> None:
        stats = TransferStats(
            self.req.request_id,
            "send",
            self.plan.total_bytes if ok else 0,
            self.plan.num_chunks,
            time.perf_counter() - start,
            ok,
            error,
            "ucx",  # P serves only UCX pulls; direct reads are recorded on ReadDone
        )
        self.sender.book.record(stats)


async def settle(tasks: list[asyncio.Future], timeout: float) -> bool:
    """Wait until every task has ended; False if some are still running after ``timeout``."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=timeout)
        return not still
    return True
