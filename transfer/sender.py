"""KVSender: the prefill side of the transceiver.

    sender = KVSender(kv.buffers, specs, model="smollm2", config=cfg, release=on_release)
    ticket = sender.publish(request_id, kv.page_ids(request_id), declared_prompt_len=len(prompt))
    # ... the router carries the ticket to a decode worker, which pulls ...
    # on_release(request_id) runs exactly once: after the pull, on lease expiry, on a cancel, or
    # when the sender closes.

Ownership of pages: from ``publish`` until the release callback the pages belong to the transfer;
the worker must not free or reuse them, and must have finished writing them (device work done)
before publishing. The callback runs on the transceiver's loop thread: keep it short and
thread-safe (hand the id to the worker's own loop). Pulls are served in the background.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import NULL_PAGE, PoolGroupSpec
from transfer import paths
from transfer.config import TransceiverConfig
from transfer.faults import FaultInjector
from transfer.handshake import accept
from transfer.leases import LeaseTable
from transfer.link import Link, deliver_reject
from transfer.mapper import Segment
from transfer.messages import (
    ChunkReady,
    Message,
    PullError,
    PullRequest,
    Ready,
    Reject,
    TransferAck,
    TransferTicket,
)
from transfer.page_table import PageTable
from transfer.paths.staging import Chunk, StagingBuffers, chunk_bytes_for, cut_chunks
from transfer.pools import pool_rows
from transfer.runtime import UcxRuntime
from transfer.serve import ServeSession, admit, answer_credits
from transfer.stats import StatsBook

log = logging.getLogger(__name__)


class KVSender:
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
        release: Callable[[str], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Start listening on ``config.host``/``config.port``.

        Args:
            buffers: the KV storage per pool group (KVCacheManager.buffers).
            specs: the pool groups, in order.
            model: model identity for the compatibility hash (peers must agree on it).
            release: called with a request id when its pages may be freed (module docstring).
            loop: the caller's running loop for the process's transfer runtime to run on (a
                worker passes its own), or None for a loop thread of the runtime's own.
        """
        self.config = config
        self.page_table = PageTable.from_specs(model, specs)
        self.instance_id = uuid.uuid4().hex
        self.rows = pool_rows(buffers, {s.name: s.page_bytes for s in specs})
        self.book = StatsBook(config.max_stats_len)
        self.faults = FaultInjector(config.fault_injection)
        self._release = release
        self.leases = LeaseTable(lambda lease: release(lease.request_id))
        self.links: set[Link] = set()
        self.sessions: dict[tuple[Link, int], ServeSession] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._accepting = threading.Lock()  # publish's check and lease against close
        self.offered, self._export = paths.offer(self.rows) if config.direct_copy else ("", b"")
        device = next(iter(buffers.values())).device
        gpu = device.index if device.type == "cuda" else None
        if device.type == "cuda" and gpu is None:
            gpu = torch.cuda.current_device()
        self.runtime = UcxRuntime.acquire(
            config.ucx_env, gpu, config.ucx_progress_mode(device.type == "cuda"), loop
        )
        try:
            self.staging = StagingBuffers(
                device,
                chunk_bytes_for(self.page_table, config.staging_tokens),
                config.staging_buffers,
            )
            # Bound here, so that an address that cannot be used fails the constructor; served
            # on the loop (a pull that comes first waits in the listen backlog).
            family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.create_server((config.host, config.port), family=family)
        except BaseException:
            self.runtime.release()
            raise
        self.host, self.port = listener.getsockname()[:2]
        self._started = self.runtime.submit(self._start(listener))
        self._started.add_done_callback(_log_failure)

    async def _start(self, listener: socket.socket) -> None:
        self._server = await asyncio.start_server(self._on_connect, sock=listener)
        self._reaper = asyncio.ensure_future(self._reap())

    # ---- API (any thread) ----
    def publish(
        self,
        request_id: str,
        page_ids: Mapping[str, Sequence[int]],
        declared_prompt_len: int,
        heads: tuple[int, int] | None = None,
    ) -> TransferTicket:
        """Pin the request's pages under a lease and return the ticket D pulls with.
        ``page_ids``: per group, the request's page list in token order (KVCacheManager.page_ids:
        a window group shows the null page where it released pages); the ticket lists only the
        pages each group holds. ``heads`` (first, count): the one pull of this lease moves only
        those KV heads of each page (a decode rank of another tensor-parallel size)."""
        pages: dict[str, list[int]] = {}
        first_page: dict[str, int] = {}
        names = [p.name for p in self.page_table.pools]
        if sorted(page_ids) != sorted(names):
            raise ValueError(
                f"publish {request_id!r}: page ids name pools {sorted(page_ids)}, expected "
                f"{sorted(names)}"
            )
        for pool in self.page_table.pools:
            ids = [int(p) for p in page_ids[pool.name]]
            first = next((i for i, p in enumerate(ids) if p != NULL_PAGE), len(ids))
            held = ids[first:]
            bad = [p for p in held if not 0 < p < pool.num_pages]
            if bad:
                raise ValueError(
                    f"publish {request_id!r}: pool {pool.name!r} has no pages {bad[:8]} (only a "
                    "window group's first pages may be the null page)"
                )
            pages[pool.name], first_page[pool.name] = held, first
            if heads is not None and not (
                heads[1] >= 1
                and pool.head_start <= heads[0]
                and heads[0] + heads[1] <= pool.head_start + pool.num_kv_heads
            ):
                raise ValueError(
                    f"publish {request_id!r}: pool {pool.name!r} holds KV heads "
                    f"[{pool.head_start}, {pool.head_start + pool.num_kv_heads}), not all of "
                    f"[{heads[0]}, {heads[0] + heads[1]})"
                )
        if declared_prompt_len < 0:
            raise ValueError(f"publish {request_id!r}: declared_prompt_len must be >= 0")
        with self._accepting:  # (a lease made as close began would never be released)
            if self._closed:
                raise RuntimeError("KVSender is closed")
            lease = self.leases.publish(
                request_id, pages, declared_prompt_len, self.config.lease_s, heads
            )
        return TransferTicket(
            request_id=request_id,
            host=self.host,
            port=self.port,
            instance_id=self.instance_id,
            page_ids=pages,
            first_page=first_page,
            declared_prompt_len=declared_prompt_len,
            compat_hash=self.page_table.compat_hash,
            lease_gen=lease.gen,
            lease_expires_at=time.time() + self.config.lease_s,
        )

    def cancel(self, request_id: str, lease_gen: int | None = None) -> bool:
        """The request is abandoned: free its pages now, unless a pull holds them (False; the
        pull's end releases them). With ``lease_gen``, only that lease of the request (the
        ticket's ``lease_gen``), never a later publish of it."""
        return self.leases.cancel(request_id, lease_gen)

    def stats(self) -> dict[str, Any]:
        return {
            **self.book.snapshot(),
            "leases": len(self.leases),
            "peers": len(self.links),
            "pulls_in_flight": len(self.sessions),
        }

    def drain_transfer_stats(self) -> list[Any]:
        return self.book.drain()

    def close(self) -> None:
        """Stop serving: close every link (ending its pulls), stop listening, release every
        lease. Later calls do nothing."""
        with self._accepting:
            if self._closed:
                return
            self._closed = True
        try:
            self.runtime.run(self._stop(), timeout=self.config.chunk_deadline_s * 2 + 5.0)
        finally:
            self.leases.release_all("the sender closed")
            self.runtime.release()

    async def _stop(self) -> None:
        try:
            await asyncio.wrap_future(self._started)
        except Exception:  # it never served (logged where it failed): nothing to stop
            return
        self._reaper.cancel()
        self._server.close()
        for link in list(self.links):
            link.abort("the sender is closing")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.chunk_deadline_s * 2)
        await self._server.wait_closed()

    # ---- for the sessions ----
    def cut(self, segments: list[Segment], sizes: list[int]) -> list[Chunk]:
        """D's chunk plan for the segments, cut; ValueError when it does not fit them or our
        staging buffers."""
        if sizes and max(sizes) > self.staging.nbytes:
            raise ValueError(
                f"a chunk of {max(sizes)} bytes does not fit our staging buffers of "
                f"{self.staging.nbytes}"
            )
        return cut_chunks(segments, sizes)

    # ---- loop side ----
    async def _reap(self) -> None:
        interval = min(1.0, max(0.01, self.config.lease_s / 8))
        while True:
            await asyncio.sleep(interval)
            expired = self.leases.expire_due()
            if expired:
                self.book.bump("expired_leases", expired)
                log.info("%d leases expired; their pages were released", expired)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = await accept(
            self.runtime,
            reader,
            writer,
            self.config.secret.encode(),
            self.instance_id,
            self.page_table,
            self._export,
            self.config.connect_deadline_s,
            self.book.counters,
            lambda name: paths.for_peer(name, self.offered),
        )
        if link is None:
            return
        if self._closed:
            link.abort("the sender is closing")
            return
        self.links.add(link)
        link.add_close_listener(lambda _reason: self.links.discard(link))
        link.start(lambda msg: self._on_message(link, msg))

    def _on_message(self, link: Link, msg: Message) -> None:
        if isinstance(msg, PullRequest):
            self._start_serving(link, msg)
        elif isinstance(msg, ChunkReady | TransferAck):
            session = self.sessions.get((link, msg.pull_id))
            if session is not None:
                session.deliver(msg)
            elif isinstance(msg, TransferAck) and not msg.ok:
                # D gave the ticket up before pulling it: its lease may go now.
                how = f"the decode side gave the ticket up: {msg.error}"
                self.leases.end_unpulled(msg.request_id, msg.lease_gen, how)
            else:
                log.info(
                    "%s for pull %d of %s dropped: no such pull here",
                    type(msg).__name__,
                    msg.pull_id,
                    msg.request_id,
                )
        elif isinstance(msg, Reject):
            deliver_reject(msg, link, self.sessions.values())
        elif not isinstance(msg, Ready):
            log.warning("%s: unexpected %s dropped", link.name, type(msg).__name__)

    def _start_serving(self, link: Link, req: PullRequest) -> None:
        key = (link, req.pull_id)
        if key in self.sessions:
            # The credits belong to the other pull's receives, left alone; D knows the refusal
            # is not that pull's by its request id.
            self.book.bump("refused_pulls")
            err = PullError(req.request_id, req.pull_id, "mismatch", "pull id in use")
            self._spawn(self._refuse(link, req, err, False))
            return
        answer = admit(self, link, req)
        if not isinstance(answer, ServeSession):
            self._spawn(self._refuse(link, req, answer, True))
            return
        self.sessions[key] = answer
        task = self._spawn(answer.run())
        task.add_done_callback(lambda _t: self.sessions.pop(key, None))

    async def _refuse(self, link: Link, req: PullRequest, err: PullError, answer: bool) -> None:
        if answer:
            await answer_credits(link, req, self.config.chunk_deadline_s)
        try:
            await link.send(err, self.config.done_deadline_s)
        except ConnectionError as e:
            log.info("refusal of %s not sent: %s", req.request_id, e)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _log_failure(started: concurrent.futures.Future[None]) -> None:
    if not started.cancelled() and started.exception() is not None:
        log.error("the transfer listener did not start serving: %r", started.exception())
