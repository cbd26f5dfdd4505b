"""KVSender: the prefill side of the transceiver.

    sender = KVSender(kv.buffers, specs, model="smollm2", config=cfg, release=on_release)
    ticket = sender.publish(request_id, kv.page_ids(request_id), declared_prompt_len=len(prompt))
    # ... the router carries the ticket to a decode worker, which pulls ...
    # on_release(request_id) runs exactly once: after D's ack, on lease expiry, or on a failure.

Ownership of pages: from ``publish`` until the release callback the pages belong to the transfer;
the worker must not free or reuse them, and must have finished writing them (device work done)
before publishing. The callback runs on the transceiver's loop thread: keep it short and
thread-safe (hand the id to the worker's own loop). Serving pulls happens in the background.

With ``direct_copy`` every lease is also put on a lease board in shared memory (lease_board.py), and
the pools are exported in the handshake (ipc.py): a decode worker that can open them reads the pages
itself and only tells us afterwards (a record on its done board, or ReadDone: read_ends.py), so
such pulls cost this side no work at all.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer.admit import admit, refuse
from transfer.config import TransceiverConfig
from transfer.ipc import IpcExport, IpcUnavailable, export_pools, unexport
from transfer.lease_board import BoardUnavailable, LeaseBoard, lease_digest
from transfer.leases import Lease, LeaseTable
from transfer.messages import (
    ChunkReady,
    HelloReply,
    Message,
    PullError,
    PullRequest,
    ReadDone,
    Reject,
    TransferAck,
    TransferTicket,
)
from transfer.peer import PeerLink, accept
from transfer.prestage import Prestager
from transfer.read_ends import ReadEnds
from transfer.serve import ServeSession, drain, settle
from transfer.side import TransceiverSide

log = logging.getLogger(__name__)


ENDED_PULLS_KEPT = 4096  # ended pulls whose late credits are still completed (pull ids are random)


class KVSender(TransceiverSide):
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
        release: Callable[[str], None],
    ) -> None:
        """Start listening on ``config.host``/``config.port``.

        Args:
            buffers: the KV storage per pool group (KVCacheManager.buffers).
            specs: the pool groups, in order.
            model: model identity for the compatibility hash (peers must agree on it).
            release: called with a request id when its pages may be freed (see module docstring).
        """
        super().__init__(buffers, specs, model, config)
        self._release = release
        self.leases = LeaseTable(self._released)
        self.read_ends = ReadEnds(self.leases, self.book)
        self._links: set[PeerLink] = set()
        self._sessions: dict[int, ServeSession] = {}  # pull id -> session
        # Pulls refused or ended, by (link, pull id) -> their chunk count: D may still credit
        # chunks of them (its receives freed staging buffers before it read our answer), and each
        # such receive must be completed, or D waits for it and then aborts the link.
        self._ended: collections.OrderedDict[tuple[PeerLink, int], int] = collections.OrderedDict()
        self._session_tasks: set[asyncio.Task] = set()
        # Links that sent a PullRequest, and the agreed chunk size of the latest (prestage.py;
        # read by publish on other threads: a set's truth and an int are safe to read there).
        self._ucx_pullers: set[PeerLink] = set()
        self._puller_chunk_bytes = self.chunk_bytes
        self.board: LeaseBoard | None = None
        self._generations = itertools.count(1)  # leases' generations when there is no board
        self._export: IpcExport | None = None
        try:
            if config.direct_copy:
                self._offer_direct_reads()
            self.host, self.port = self.runtime.run(
                self._start(), timeout=config.connect_deadline_s
            )
        except BaseException:
            self._withdraw_direct_reads()
            self.runtime.release()
            raise

    def _offer_direct_reads(self) -> None:
        """The lease board and the pool export that let same-host decode workers read directly."""
        try:
            # More slots than pages: prefix sharing lets several leases hold one page. A lease
            # that finds none free is pulled over UCX.
            self.board = LeaseBoard(max(1024, 4 * max(p.num_pages for p in self.page_table.pools)))
        except BoardUnavailable as e:
            log.warning("no lease board (%s): decode workers pull over UCX", e)
            return
        try:
            self._export = export_pools(self.rows, share=True)
        except IpcUnavailable as e:
            log.warning(
                "pools not shared with other processes (%s): only same-process peers read directly",
                e,
            )
            self._export = export_pools(self.rows, share=False)

    def _withdraw_direct_reads(self) -> None:
        if self._export is not None:
            unexport(self._export)
            self._export = None
        if self.board is not None:
            self.board.close()
            self.board = None

    def _released(self, lease: Lease) -> None:
        """The lease ended: off the board first (a direct read in flight then fails its check
        instead of keeping pages the worker is about to reuse), then the worker frees the pages."""
        board = self.board
        if self.config.prestage:
            # Before the pages go back (the worker may reuse them at once); always, since an offer
            # may be queued behind this release. (take() checks the lease too: this is for the
            # buffer.)
            self._on_loop(self.prestage.drop, lease)
        try:
            if lease.slot >= 0 and board is not None:
                board.retire(lease.slot, lease.gen)
        finally:  # the pages go back whatever happened to the board
            self._release(lease.request_id)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the loop thread: now if we are on it, else soon. Its errors are
        logged, never raised into the caller (a publish, a lease release)."""
        if self.runtime.on_loop():
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))
        else:
            try:
                self.runtime.call_soon(fn, *args)
            except RuntimeError:  # the loop is gone (closing): so are the staging buffers
                pass

    async def _start(self) -> tuple[str, int]:
        self.staging = self._make_staging()
        self.prestage = Prestager(self)
        self._server = await asyncio.start_server(
            self._on_connect, self.config.host, self.config.port
        )
        self._reaper = asyncio.ensure_future(self._reap())
        self._read_ends_task = asyncio.ensure_future(self.read_ends.run())
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    # ---- API (any thread) ----
    def publish(
        self, request_id: str, page_ids: Mapping[str, Sequence[int]], declared_prompt_len: int
    ) -> TransferTicket:
        """Pin the request's pages under a lease and return the ticket D pulls with."""
        pages = {g: [int(p) for p in ids] for g, ids in page_ids.items()}
        names = [p.name for p in self.page_table.pools]
        if sorted(pages) != sorted(names):
            raise ValueError(
                f"publish {request_id!r}: page ids name pools {sorted(pages)}, expected {sorted(names)}"
            )
        for pool in self.page_table.pools:
            bad = [p for p in pages[pool.name] if not 0 < p < pool.num_pages]
            if bad:
                raise ValueError(
                    f"publish {request_id!r}: pool {pool.name!r} has no pages {bad[:8]}"
                )
        if declared_prompt_len < 0:
            raise ValueError(f"publish {request_id!r}: declared_prompt_len must be >= 0")
        board = self.board
        placed = (
            board.publish(declared_prompt_len, lease_digest(request_id, pages)) if board else None
        )
        # Every lease gets a generation of its own, which acks name (with no board slot, one that
        # no board slot's lease has either).
        slot, gen = placed if placed is not None else (-1, self._fresh_generation())
        try:
            self.leases.publish(
                request_id, pages, declared_prompt_len, self.config.lease_s, slot, gen
            )
        except BaseException:
            if board is not None and slot >= 0:
                board.retire(slot, gen)
            raise
        if self.config.prestage and self._ucx_pullers:
            # Cut with a UCX puller's chunk size (the agreed one: the smaller of the two sides').
            self._on_loop(self.prestage.offer, request_id, pages, self._puller_chunk_bytes)
        return TransferTicket(
            request_id=request_id,
            host=self.host,
            port=self.port,
            instance_id=self.instance_id,
            page_ids=pages,
            declared_prompt_len=declared_prompt_len,
            compat_hash=self.page_table.compat_hash,
            lease_expires_at=time.time() + self.config.lease_s,
            lease_slot=slot,
            lease_gen=gen,
        )

    def _fresh_generation(self) -> int:
        board = self.board
        return board.fresh_generation() if board is not None else next(self._generations)

    def cancel(self, request_id: str) -> bool:
        """The request is abandoned: free its pages now, unless a pull is reading them (False; the
        pull's end releases them then)."""
        return self.leases.cancel(request_id)

    def stats(self) -> dict[str, Any]:
        return {**self.book.snapshot(), "leases": len(self.leases), "peers": len(self._links)}

    def close(self) -> None:
        """Stop serving: abort links (ending their sends), stop listening, release every lease.
        Once: later calls do nothing."""
        if not self._begin_close():
            return
        try:
            # (_stop waits for the sessions, then for prestage gathers: a deadline each)
            self.runtime.run(self._stop(), timeout=self.config.chunk_deadline_s * 2 + 5.0)
        finally:
            self.leases.release_all("transceiver closed")
            self._withdraw_direct_reads()
            self.runtime.release()

    async def _stop(self) -> None:
        self._reaper.cancel()
        self._read_ends_task.cancel()
        self._server.close()
        for link in list(self._links):
            link.abort("sender closing")
        await settle(list(self._session_tasks), self.config.chunk_deadline_s)
        await self.prestage.close(self.config.chunk_deadline_s)
        await self._server.wait_closed()

    # ---- loop side ----
    async def _reap(self) -> None:
        interval = min(1.0, max(0.01, min(self.config.lease_s, self.config.ack_deadline_s) / 8))
        while True:
            await asyncio.sleep(interval)
            expired = self.leases.expire_due()
            self.book.counters.expired_leases += len(expired)
            for rid in expired:
                log.info("lease of %s expired; pages released", rid)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        own = HelloReply(
            self.instance_id,
            self.page_table,
            self.runtime.worker_address,
            self.chunk_bytes,
            "",
            self._export.to_wire() if self._export is not None else b"",
            self.board.path if self.board is not None else "",
            piece_chunk_bytes=self.piece_chunk_bytes,
        )
        link = await accept(
            self.runtime, reader, writer, own, self.config.connect_deadline_s, self.book.counters
        )
        if link is None:
            return
        self._links.add(link)
        link.add_close_listener(lambda _reason: self._forget(link))
        self.read_ends.add_link(link)
        link.start(lambda msg: self._on_message(link, msg))

    def _on_message(self, link: PeerLink, msg: Message) -> None:
        if isinstance(msg, PullRequest):
            if not link.closed:
                self._ucx_pullers.add(link)
                self._puller_chunk_bytes = link.info.chunk_bytes
            self._start_serving(link, msg)
        elif isinstance(msg, ChunkReady):
            session = self._sessions.get(msg.pull_id)
            if session is not None and session.link is link:
                session.credit(msg.chunks)
            elif (link, msg.pull_id) in self._ended:
                chunks = self._ended[(link, msg.pull_id)]
                self.drain_late(link, msg.pull_id, [i for i in msg.chunks if 0 <= i < chunks])
            else:
                log.info(
                    "credit for pull %d of %s dropped: no such pull", msg.pull_id, msg.request_id
                )
        elif isinstance(msg, TransferAck):
            self._on_ack(link, msg)
        elif isinstance(msg, ReadDone):
            self.read_ends.on_read_done(msg)
        elif isinstance(msg, Reject):
            log.warning("%s rejected a message of ours: %s", link.name, msg.reason)
        else:
            log.warning("%s: unexpected %s dropped", link.name, type(msg).__name__)

    def _on_ack(self, link: PeerLink, ack: TransferAck) -> None:
        session = self._sessions.get(ack.pull_id)
        if (
            session is not None
            and session.serving
            and session.link is link
            and session.req.request_id == ack.request_id
        ):
            session.ack(ack.ok, ack.error)  # sends may still be completing: the session releases
            return
        how = "acked" if ack.ok else f"decode side failed the transfer: {ack.error}"
        if not self.leases.end_on_ack(ack.request_id, ack.lease_gen, ack.ok, how):
            log.info(
                "ack of pull %d of %s dropped: no lease of it here that it may end",
                ack.pull_id,
                ack.request_id,
            )

    def _start_serving(self, link: PeerLink, req: PullRequest) -> None:
        answer = admit(
            self.leases,
            self.page_table,
            self.book.counters,
            link,
            req,
            req.pull_id in self._sessions,
        )
        if isinstance(answer, PullError):
            # (A conflict is a pull id in use by another pull: its late credits are not ours.)
            if answer.code != "conflict":
                self._mark_ended(link, req)
            asyncio.ensure_future(refuse(link, req, answer, self.config))
            return
        plan, lease = answer
        session = ServeSession(self, link, req, plan, lease)
        self._sessions[req.pull_id] = session
        session.begin()
        task = asyncio.ensure_future(session.run())
        self._session_tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._session_tasks.discard(t)
            self._sessions.pop(req.pull_id, None)
            self._mark_ended(link, req)

        task.add_done_callback(finished)

    def _forget(self, link: PeerLink) -> None:
        self._links.discard(link)
        self._ucx_pullers.discard(link)
        for key in [k for k in self._ended if k[0] is link]:
            del self._ended[key]

    def _mark_ended(self, link: PeerLink, req: PullRequest) -> None:
        if link.closed:
            return
        self._ended[(link, req.pull_id)] = req.num_chunks
        while len(self._ended) > ENDED_PULLS_KEPT:
            self._ended.popitem(last=False)

    def drain_late(self, link: PeerLink, pull_id: int, chunks: list[int]) -> None:
        """Complete D's receives for ``chunks`` of a pull that has ended or is failing."""
        if chunks and not link.closed:
            task = asyncio.ensure_future(self._drain(link, pull_id, chunks))
            self._session_tasks.add(task)  # (close() waits for these too)
            task.add_done_callback(self._session_tasks.discard)

    async def _drain(self, link: PeerLink, pull_id: int, chunks: list[int]) -> None:
        try:
            await asyncio.wait_for(drain(link, pull_id, chunks), self.config.chunk_deadline_s)
        except Exception as e:  # ucxx errors are not all ConnectionErrors
            link.abort(f"completing the receives of ended pull {pull_id} failed: {e!r}")
