"""KVReceiver: the decode side of the transceiver.

    receiver = KVReceiver(kv.buffers, specs, model="smollm2", config=cfg)
    result = await receiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)
    if not result.ok: free the pages (result.error says why)

``dst_page_ids[g]`` are D's pages for the request's pages from ``skip_pages`` on, up to its last,
one for one: the request's first ``skip_pages`` pages D already holds from its own prefix hit, or
does not need (a sliding-window group's pages before its window). ``skip_pages`` counts from the
request's first page (the ticket lists group g's pages from ``ticket.first_page[g]``), and may be
given per group.
``pull`` returns only when the transfer is complete and checked, or has failed and nothing of it
can still write the pages, so the caller may free them then; a cancelled ``pull`` too, before its
CancelledError. It never raises for transfer problems: they are a failed TransferResult.

One link per prefill worker (handshake.py) is made on first use and shared by concurrent pulls. A
ticket of another instance than the link's is stale, or the first sign of a restart the link has
not seen yet: a fresh handshake tells which.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer import paths
from transfer.config import TransceiverConfig
from transfer.faults import FaultInjector
from transfer.handshake import PeerRefused, connect
from transfer.link import Link, deliver_reject
from transfer.mapper import Segment
from transfer.messages import Message, PullError, ReadGrant, Reject, TransferDone, TransferTicket
from transfer.page_table import PageTable
from transfer.paths.base import PullFailed
from transfer.paths.staging import Chunk, StagingBuffers, chunk_bytes_for, cut_chunks, plan
from transfer.pools import pool_rows
from transfer.pull import ACK_DELAY_S, PullSession
from transfer.runtime import UcxRuntime
from transfer.stats import StatsBook, TransferResult

log = logging.getLogger(__name__)

Address = tuple[str, int]


class KVReceiver:
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
        loop: asyncio.AbstractEventLoop | None = None,
        on_wedged: Callable[[str], None] | None = None,
    ) -> None:
        """``buffers``: the KV storage per pool group (KVCacheManager.buffers); ``specs``: the
        pool groups, in order; ``model``: identity for the compatibility hash; ``loop``: the
        caller's running loop for the process's transfer runtime to run on (a worker passes its
        own, where it awaits ``pull``), or None for a loop thread of the runtime's own.
        ``on_wedged(problem)``: a pull's UCX receives outlived the abort of their link (a
        transport that does not end what it was asked to), so they may still write its pages,
        which can then never be freed: a worker takes its process down here
        (tp_ranks.take_worker_down). Without it the pull logs and keeps waiting for them."""
        self.config = config
        self.on_wedged = on_wedged
        self.page_table = PageTable.from_specs(model, specs)
        self.instance_id = uuid.uuid4().hex
        self.rows = pool_rows(buffers, {s.name: s.page_bytes for s in specs})
        self.book = StatsBook(config.max_stats_len)
        self.faults = FaultInjector(config.fault_injection)
        self.chunk_bytes = chunk_bytes_for(self.page_table, config.staging_tokens)
        self.sessions: dict[int, PullSession] = {}
        self.links: dict[Address, Link] = {}
        self._connecting: dict[Address, asyncio.Lock] = {}
        self._ever_linked: set[Address] = set()
        self._running: set[concurrent.futures.Future] = set()
        self.closed = False
        # Held while a pull is accepted and while close starts: a pull accepted on another
        # thread as close began was not among those close waited for (and after the last
        # release it was left on a stopped loop, its caller waiting for ever).
        self._accepting = threading.Lock()
        device = next(iter(buffers.values())).device
        gpu = device.index if device.type == "cuda" else None
        if device.type == "cuda" and gpu is None:
            gpu = torch.cuda.current_device()
        self.runtime = UcxRuntime.acquire(
            config.ucx_env, gpu, config.ucx_progress_mode(device.type == "cuda"), loop
        )
        self.staging = StagingBuffers(device, self.chunk_bytes, config.staging_buffers)

    # ---- API (any thread, any event loop) ----
    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int | Mapping[str, int],
        expected_prompt_len: int,
        heads: tuple[int, int] | None = None,
    ) -> TransferResult:
        """Pull the request's KV into ``dst_page_ids`` (module docstring). ``heads``: (first,
        count), only those KV heads of each page (a tensor-parallel rank's share from one
        prefill rank, transfer/tp_mapper.py); None: whole pages of equal pools."""
        session, done = self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len, heads)
        here = isinstance(done, asyncio.Future)  # on the runtime's loop: no hop either way
        waiting = done if here else asyncio.wrap_future(done)
        try:
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            if here:
                session.cancel()
            else:
                self.runtime.call_soon(session.cancel)
            while not done.done():  # bounded by its deadlines (or on_wedged); the pages wait
                try:
                    await asyncio.shield(waiting)
                except asyncio.CancelledError:
                    continue
            raise

    def pull_blocking(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int | Mapping[str, int],
        expected_prompt_len: int,
        heads: tuple[int, int] | None = None,
    ) -> TransferResult:
        """``pull`` for plain threads."""
        return self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len, heads)[
            1
        ].result()

    def stats(self) -> dict[str, Any]:
        return {
            **self.book.snapshot(),
            "peers": len(self.links),
            "pulls_in_flight": len(self._running),
        }

    def drain_transfer_stats(self) -> list[Any]:
        return self.book.drain()

    def close(self) -> None:
        """Fail the pulls in flight (their pages are safe once this returns) and drop every
        link. Later calls do nothing."""
        with self._accepting:
            if self.closed:
                return
            self.closed = True
        try:
            self.runtime.run(self._stop(), timeout=self.config.chunk_deadline_s * 4 + 5.0)
        finally:
            self.runtime.release()

    async def _stop(self) -> None:
        await asyncio.sleep(ACK_DELAY_S)  # the last pulls' success notices go out first
        for link in list(self.links.values()):
            link.abort("the receiver is closing")
        for session in list(self.sessions.values()):
            session.cancel()
        running = [
            f if isinstance(f, asyncio.Future) else asyncio.wrap_future(f) for f in self._running
        ]
        if running:
            _, late = await asyncio.wait(running, timeout=self.config.chunk_deadline_s * 3)
            for f in late:  # (one still connecting, say: its connect deadline may be longer)
                f.cancel()
            if late:
                await asyncio.wait(late, timeout=self.config.chunk_deadline_s)

    def _submit(
        self,
        ticket: TransferTicket,
        dst: Mapping[str, Sequence[int]],
        skip: int | Mapping[str, int],
        expected: int,
        heads: tuple[int, int] | None = None,
    ) -> tuple[PullSession, concurrent.futures.Future[TransferResult] | asyncio.Task]:
        """The pull as a task on the runtime's loop: started right here when the caller runs on
        that loop (a worker whose loop the runtime adopted), else handed over to it."""
        skips = {g: int(skip) for g in ticket.page_ids} if isinstance(skip, int) else dict(skip)
        done: concurrent.futures.Future[TransferResult] | asyncio.Task
        with self._accepting:
            if self.closed:
                raise RuntimeError("KVReceiver is closed")
            session = PullSession(self, ticket, dst, skips, int(expected), heads)
            if self.runtime.on_loop():
                done = asyncio.ensure_future(session.run())
            else:
                done = self.runtime.submit(session.run())
            self._running.add(done)
        done.add_done_callback(self._running.discard)
        return session, done

    # ---- for the sessions (loop thread) ----
    def cut(self, segments: list[Segment], peer: PageTable) -> list[Chunk]:
        """Our chunk plan for a pull's segments, cut (paths/staging.py): no chunk larger than
        our staging buffers or the ``peer``'s. Its buffers hold as many tokens as ours
        (``staging_tokens`` is the cluster's) of its own pools, which are smaller than ours
        where a prefill rank of a larger tensor-parallel size serves a head slice of our pages."""
        limit = min(self.chunk_bytes, chunk_bytes_for(peer, self.config.staging_tokens))
        return cut_chunks(segments, plan(segments, limit, self.staging.device))

    async def link_for(self, ticket: TransferTicket) -> Link:
        """The link to the ticket's prefill worker, (re)connected if needed, within one
        ``connect_deadline_s`` in all (the wait for another pull's connect included). Raises
        PullFailed."""
        key = (ticket.host, ticket.port)
        link = self.links.get(key)
        if link is not None and not link.closed and link.peer_instance == ticket.instance_id:
            return link
        limit = self.config.connect_deadline_s
        try:
            async with asyncio.timeout(limit):
                async with self._connecting.setdefault(key, asyncio.Lock()):
                    return await self._link_for(key, ticket)
        except TimeoutError:
            raise PullFailed(f"connecting to {key[0]}:{key[1]} timed out after {limit}s") from None
        except PeerRefused as e:
            raise PullFailed(str(e)) from None
        except OSError as e:
            raise PullFailed(f"cannot connect to {key[0]}:{key[1]}: {e}") from None

    async def _link_for(self, key: Address, ticket: TransferTicket) -> Link:
        link = self.links.get(key)
        if link is None or link.closed:
            link = self._keep(key, await self._connect(key))
        if link.peer_instance != ticket.instance_id:
            # A stale ticket (the open link is fine, and pulls on it need it), or a restart
            # this link has not noticed yet: whoever answers a fresh handshake tells.
            fresh = await self._connect(key)
            if fresh.peer_instance == link.peer_instance:
                fresh.abort("the peer had not restarted")
            else:
                link.abort("the peer restarted")
                link = self._keep(key, fresh)
        if link.peer_instance != ticket.instance_id:
            raise PullFailed(
                f"stale ticket: instance {ticket.instance_id} published it, but {key[0]}:{key[1]} "
                f"now runs instance {link.peer_instance} (the prefill worker restarted; its pages "
                "are gone)"
            )
        return link

    async def _connect(self, key: Address) -> Link:
        async def choose(export: bytes, peer: PageTable) -> paths.DataPath:
            return await self.runtime.off_loop(paths.choose, export, peer, self.rows)

        return await connect(
            self.runtime,
            key[0],
            key[1],
            self.config.secret.encode(),
            self.instance_id,
            self.page_table,
            self.config.connect_deadline_s,
            self.book.counters,
            choose if self.config.direct_copy else _ucx_only,
        )

    def _keep(self, key: Address, link: Link) -> Link:
        if self.closed:  # made by a pull that connected while we closed: nobody would close it
            link.abort("the receiver is closed")
            raise PullFailed("the receiver is closed")
        if key in self._ever_linked:
            self.book.bump("reconnects")
        self._ever_linked.add(key)
        self.links[key] = link

        def closed(_reason: str) -> None:
            if self.links.get(key) is link:
                del self.links[key]

        link.add_close_listener(closed)
        link.start(lambda msg: self._on_message(link, msg))
        return link

    def _on_message(self, link: Link, msg: Message) -> None:
        if isinstance(msg, PullError | TransferDone | ReadGrant):
            session = self.sessions.get(msg.pull_id)
            # (Its request too: P answers a pull id in use with the refused request's name.)
            if (
                session is not None
                and session.link is link
                and session.request_id == msg.request_id
            ):
                session.deliver(msg)
            else:
                log.info(
                    "late %s for pull %d of %s dropped",
                    type(msg).__name__,
                    msg.pull_id,
                    msg.request_id,
                )
        elif isinstance(msg, Reject):
            deliver_reject(msg, link, self.sessions.values())
        else:
            log.warning("%s: unexpected %s dropped", link.name, type(msg).__name__)


async def _ucx_only(_export: bytes, _peer: PageTable) -> paths.DataPath:
    return paths.UcxPath()
