"""PeerLinks: the decode side's links to prefill workers, one per address, shared by concurrent
pulls and made on first use.

A closed link, or a ticket from another instance of the worker at that address, makes the next pull
connect again. Such a ticket is either stale (published before a restart: the open link is fine,
and reads in flight on it need it) or the first sign of a restart the link has not noticed yet; a
bare handshake with the address (a probe: no pools opened, no done board) tells which, and its
answer is kept per (address, instance) until that link closes, so many stale tickets cost one
probe. With ``direct_copy`` a new link also opens P's pools and lease board when it can (ipc.py),
and offers P a done board (done_board.py). Loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from transfer.done_board import DoneBoard, DoneBoardUnavailable
from transfer.ipc import IpcExport, IpcUnavailable, host_identity, open_pools
from transfer.lease_board import BoardUnavailable, LeaseBoardView
from transfer.messages import Hello, HelloReply, Message, TransferTicket
from transfer.peer import DirectAccess, PeerLink, PeerRefused, connect
from transfer.primer import PrimerReceive
from transfer.pull_checks import PullFailed

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)

Address = tuple[str, int]
STALE_KEPT = 1024  # stale instances remembered per open link


class PeerLinks:
    def __init__(
        self, receiver: KVReceiver, on_message: Callable[[PeerLink, Message], None]
    ) -> None:
        self.r = receiver
        self.open: dict[Address, PeerLink] = {}  # read from callers' threads too (_fast_read)
        self._on_message = on_message
        self._connecting: dict[Address, asyncio.Lock] = {}
        self._ever_connected: set[Address] = set()
        # (address, the instance there) -> instances whose tickets a probe found stale
        self._stale: dict[tuple[Address, str], set[str]] = {}

    def abort_all(self, reason: str) -> None:
        for link in list(self.open.values()):
            link.abort(reason)

    async def link_for(self, ticket: TransferTicket) -> PeerLink:
        """The cached link to the ticket's prefill worker, (re)connected if needed, within one
        ``connect_deadline_s`` in all: the wait for another pull's connect to that worker
        included, so N pulls to a worker that never answers all fail after one deadline, not
        the k-th after k of them. Raises PullFailed."""
        link = self.open.get((ticket.host, ticket.port))
        if link is not None and not link.closed and link.info.instance_id == ticket.instance_id:
            return link  # the common case: no wait, so no deadline to arm
        limit = self.r.config.connect_deadline_s
        try:
            async with asyncio.timeout(limit):
                return await self._link_for(ticket)
        except TimeoutError:
            raise PullFailed(
                f"connecting to {ticket.host}:{ticket.port} timed out after {limit}s "
                "(connect_deadline_s)"
            ) from None

    async def _link_for(self, ticket: TransferTicket) -> PeerLink:
        key = (ticket.host, ticket.port)
        counters = self.r.book.counters
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            link = self.open.get(key)
            if link is None or link.closed:
                if key in self._ever_connected:
                    counters.reconnects += 1
                self._ever_connected.add(key)
                link = self._keep(key, await self.connect(ticket))
            elif link.info.instance_id != ticket.instance_id and not self._known_stale(
                key, link, ticket
            ):
                probe = await self.connect(ticket, direct=False)
                probe.abort("probe")
                if probe.info.instance_id == link.info.instance_id:
                    stale = self._stale.setdefault((key, link.info.instance_id), set())
                    if len(stale) < STALE_KEPT:
                        stale.add(ticket.instance_id)
                else:
                    counters.reconnects += 1
                    link.abort("replaced: the peer restarted")
                    link = self._keep(key, await self.connect(ticket))
            if link.info.instance_id != ticket.instance_id:
                raise PullFailed(
                    f"stale ticket: instance {ticket.instance_id} published it, but {key[0]}:{key[1]} now runs "
                    f"instance {link.info.instance_id} (the prefill worker restarted; its pages are gone)"
                )
            return link

    def _known_stale(self, key: Address, link: PeerLink, ticket: TransferTicket) -> bool:
        """Whether a probe already found ``link``'s instance at ``key`` after a ticket of
        ``ticket``'s instance (a router may hold many tickets of a restarted worker)."""
        return ticket.instance_id in self._stale.get((key, link.info.instance_id), ())

    def _keep(self, key: Address, link: PeerLink) -> PeerLink:
        """Cache ``link`` as the one to ``key`` and start reading its messages."""
        if self.r.closed:  # made by a pull that was connecting while we closed: nobody closes it
            link.abort("receiver closed")
            raise PullFailed("the receiver is closed")
        self.open[key] = link

        def closed(_reason: str) -> None:
            if self.open.get(key) is link:
                del self.open[key]
            self._stale.pop((key, link.info.instance_id), None)

        link.add_close_listener(closed)
        link.start(lambda msg: self._on_message(link, msg))
        return link

    async def connect(self, ticket: TransferTicket, direct: bool = True) -> PeerLink:
        """A new link to the ticket's prefill worker; ``direct=False``: without opening its pools
        or offering a done board (a probe of who answers there)."""
        r = self.r
        direct = direct and r.config.direct_copy
        done = _new_done_board() if direct else None
        hello = Hello(
            r.instance_id,
            r.page_table,
            r.runtime.worker_address,
            r.chunk_bytes,
            done.path if done is not None else "",
        )
        # When we list host pages, the receive of P's primer goes out before the Hello names it.
        primer = None
        if r.piece_chunk_bytes:  # (so ``iov`` and the rendezvous size are known: side.py)
            primer = PrimerReceive(r.iov, r.runtime.rendezvous_bytes)  # type: ignore[arg-type]
            hello = dataclasses.replace(
                hello,
                piece_chunk_bytes=r.piece_chunk_bytes,
                primer_tag=primer.tag,
                primer_bytes=primer.nbytes,
            )
        timeout = r.config.connect_deadline_s
        link: PeerLink | None = None
        try:
            link = await connect(
                r.runtime,
                ticket.host,
                ticket.port,
                hello,
                timeout,
                r.book.counters,
                self._open_direct if direct else None,
                done,
                primer,
            )
        except PeerRefused as e:
            raise PullFailed(str(e)) from None
        except asyncio.TimeoutError:
            raise PullFailed(
                f"connecting to {ticket.host}:{ticket.port} timed out after {timeout}s"
            ) from None
        except OSError as e:
            raise PullFailed(f"cannot connect to {ticket.host}:{ticket.port}: {e}") from None
        finally:
            if done is not None and (
                link is None or link.access is None or link.access.done is not done
            ):
                done.close()  # the handshake failed, or P reads no board of ours
                done = None
            if primer is not None:
                primer.cancel()  # P did not send it, or the handshake failed (else: nothing)
        if done is not None:
            link.add_close_listener(lambda _reason: done.close())  # a later post does nothing
        return link

    async def _open_direct(self, reply: HelloReply) -> DirectAccess | None:
        """P's pools and lease board opened here for direct reads, or None (the link uses UCX)."""
        try:
            export = IpcExport.from_wire(reply.pool_export)
        except IpcUnavailable as e:
            log.warning("unusable pool export from that prefill worker (%s): using UCX", e)
            return None
        try:
            data_path, rows = await self.r.runtime.copy(open_pools, export, self.r.rows)
            board = LeaseBoardView(reply.lease_board)
        except Exception as e:  # whatever fails here, UCX still works
            # Expected across hosts (and when P could not share its pools); pools offered that do
            # not open here deserve a warning.
            expected = isinstance(e, IpcUnavailable | BoardUnavailable)
            offered = bool(export.pools) and export.host == host_identity()
            (log.warning if offered or not expected else log.info)(
                "no direct reads from that prefill worker (%s): using UCX", e
            )
            return None
        # The copy kernel skips ids beyond the rows it was given: rows that do not hold every page
        # P's page table promises would turn a good id into a silently skipped page.
        short = [
            p.name
            for p in reply.page_table.pools
            if p.name not in rows
            or rows[p.name].shape[0] < p.num_pages
            or rows[p.name].shape[1] != p.page_bytes
        ]
        if short:
            log.warning(
                "that prefill worker's pools %s are smaller than its page table: using UCX", short
            )
            board.close()
            return None
        return DirectAccess(data_path, rows, board)


def _new_done_board() -> DoneBoard | None:
    try:
        return DoneBoard()
    except DoneBoardUnavailable as e:
        log.info("no done board (%s): direct reads end with ReadDone messages", e)
        return None
