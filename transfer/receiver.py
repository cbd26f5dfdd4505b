"""KVReceiver: the decode side of the transceiver.

    receiver = KVReceiver(kv.buffers, specs, model="smollm2", config=cfg)
    result = await receiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)
    if not result.ok: free the pages (result.error says why)

``dst_page_ids[g]`` are D's pages for ``ticket.page_ids[g][skip_pages:]`` (the first ``skip_pages``
pages D already holds from its own prefix hit), one for one. ``pull`` returns only when the transfer
is complete and checked (then P has been acked) or has failed and no receive of it can still write
the pages. It never raises for transfer problems: they are a failed TransferResult.

One control connection and one UCX endpoint per prefill worker are cached and shared by concurrent
pulls; a closed link, or a ticket from another instance of the worker at that address (it
restarted), makes the next pull connect again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer.config import TransceiverConfig
from transfer.ipc import IpcExport, IpcUnavailable, export_pools, unexport
from transfer.messages import Hello, Message, PullError, Reject, TransferDone, TransferTicket
from transfer.peer import PeerLink, PeerRefused, connect
from transfer.pull import PullFailed, PullSession
from transfer.serve import settle
from transfer.side import TransceiverSide
from transfer.stats import TransferResult

log = logging.getLogger(__name__)


class KVReceiver(TransceiverSide):
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
    ) -> None:
        """See TransceiverSide (transfer/side.py) for the arguments."""
        super().__init__(buffers, specs, model, config)
        self._export: IpcExport | None = None
        self.sessions: dict[int, PullSession] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._ever_connected: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Future] = set()
        self._closed = False
        try:
            self._export = self._export_pools() if config.direct_copy else None
            self.runtime.run(self._start(), timeout=config.connect_deadline_s)
        except BaseException:
            self._unexport()
            self.runtime.release()
            raise

    def _export_pools(self) -> IpcExport:
        """Our pools for prefill workers that can write them directly (ipc.py)."""
        try:
            return export_pools(self.rows, cuda_ipc=True)
        except IpcUnavailable as e:
            log.warning("CUDA IPC export failed (%s): only same-process peers copy directly", e)
            return export_pools(self.rows, cuda_ipc=False)

    def _unexport(self) -> None:
        if self._export is not None:
            unexport(self._export)
            self._export = None

    async def _start(self) -> None:
        self.staging = self._make_staging()

    # ---- API (any thread / any event loop) ----
    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        """Pull the request's KV into ``dst_page_ids`` (see module docstring). Awaitable from any
        event loop; the work runs on the transceiver's loop thread."""
        return await asyncio.wrap_future(
            self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len)
        )

    def pull_blocking(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        """``pull`` for plain threads. Every step inside has its own deadline."""
        return self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len).result()

    def stats(self) -> dict[str, Any]:
        return {
            **self.book.snapshot(),
            "peers": len(self._links),
            "pulls_in_flight": len(self.sessions),
        }

    def close(self) -> None:
        """Fail pulls in flight (their pages are safe once this returns) and drop every link."""
        try:
            self.runtime.run(self._stop(), timeout=self.config.chunk_deadline_s * 2 + 5.0)
        finally:
            self._unexport()
            self.runtime.release()

    # ---- loop side ----
    def _submit(
        self, ticket: TransferTicket, dst: Mapping[str, Sequence[int]], skip: int, expected: int
    ) -> Any:
        if self._closed:
            raise RuntimeError("KVReceiver is closed")
        dst_pages = {g: [int(p) for p in ids] for g, ids in dst.items()}
        pull_id = random.getrandbits(63)
        session = PullSession(self, ticket, dst_pages, int(skip), int(expected), pull_id)
        fut = self.runtime.submit(session.run())
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)
        return fut

    async def _stop(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            link.abort("receiver closing")
        await settle(
            [asyncio.wrap_future(f) for f in list(self._tasks)], self.config.chunk_deadline_s * 2
        )

    async def link_for(self, ticket: TransferTicket) -> PeerLink:
        """The cached link to the ticket's prefill worker, (re)connected if needed."""
        key = (ticket.host, ticket.port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            link = self._links.get(key)
            if link is not None and not link.closed and link.info.instance_id == ticket.instance_id:
                return link
            if link is not None:
                link.abort("replaced: the peer restarted or the link failed")
            if key in self._ever_connected:
                self.book.counters.reconnects += 1
            self._ever_connected.add(key)
            link = await self._connect(ticket)
            if link.info.instance_id != ticket.instance_id:
                link.abort("ticket from another instance")
                raise PullFailed(
                    f"stale ticket: instance {ticket.instance_id} published it, but {key[0]}:{key[1]} now runs "
                    f"instance {link.info.instance_id} (the prefill worker restarted; its pages are gone)"
                )
            self._links[key] = link
            link.add_close_listener(
                lambda _r: self._links.pop(key, None) if self._links.get(key) is link else None
            )
            link.start(lambda msg: self._on_message(link, msg))
            return link

    async def _connect(self, ticket: TransferTicket) -> PeerLink:
        hello = Hello(
            self.instance_id,
            self.page_table,
            self.runtime.worker_address,
            self.chunk_bytes,
            self._export.to_wire() if self._export is not None else b"",
        )
        timeout = self.config.connect_deadline_s
        try:
            return await connect(
                self.runtime, ticket.host, ticket.port, hello, timeout, self.book.counters
            )
        except PeerRefused as e:
            raise PullFailed(str(e)) from None
        except asyncio.TimeoutError:
            raise PullFailed(
                f"connecting to {ticket.host}:{ticket.port} timed out after {timeout}s"
            ) from None
        except OSError as e:
            raise PullFailed(f"cannot connect to {ticket.host}:{ticket.port}: {e}") from None

    def _on_message(self, link: PeerLink, msg: Message) -> None:
        if isinstance(msg, PullError | TransferDone):
            session = self.sessions.get(msg.pull_id)
            if session is None or session.link is not link:
                log.info(
                    "late %s for pull %d of %s dropped",
                    type(msg).__name__,
                    msg.pull_id,
                    msg.request_id,
                )
            else:
                session.deliver(msg)
        elif isinstance(msg, Reject):
            hit = [
                s
                for s in self.sessions.values()
                if s.link is link and s.ticket.request_id == msg.request_id
            ]
            for session in hit:
                session.deliver(msg)
            if not hit:
                log.warning("%s: %s", link.name, msg.reason)
        else:
            log.warning("%s: unexpected %s dropped", link.name, type(msg).__name__)
