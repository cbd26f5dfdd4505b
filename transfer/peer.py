"""PeerLink: one connected peer, i.e. its control channel plus a UCX endpoint to its worker, and the
handshake that makes one (Hello / HelloReply: page tables, compatibility hash, UCX addresses, and
P's pool export and lease board, with which D may read P's pages directly: ``PeerLink.access``).

Closing a link is how transfers are cancelled: ``abort`` closes the UCX endpoint, which cancels every
receive and send posted on it, and the control channel, so the peer learns at once. Transfers on the
link see ``closed_reason`` through their ``on_closed`` callbacks and clean up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer.control import ChannelClosed, ControlChannel
from transfer.done_board import DoneBoard, DoneBoardUnavailable, DoneBoardView
from transfer.lease_board import LeaseBoardView
from transfer.mapper import MapperError, match_pools
from transfer.messages import Hello, HelloReply, Message
from transfer.page_table import PageTable
from transfer.primer import PrimerReceive, send_primer, wants_primer
from transfer.runtime import UcxRuntime
from transfer.stats import TransferCounters
from transfer.ucp_iov import IovOps

log = logging.getLogger(__name__)


class PeerRefused(ConnectionError):
    """The peer cannot be used: another compatibility hash, or a failed handshake."""


@dataclass(frozen=True)
class PeerInfo:
    instance_id: str
    page_table: PageTable
    chunk_bytes: int  # agreed: the smaller staging buffer of the two sides
    # Agreed for pulls whose chunks both sides list (primer.py): the smaller of the two sides'
    # piece chunk sizes, or 0 when one side does not list host pages or P sent no primer.
    piece_chunk_bytes: int = 0

    @property
    def pull_chunk_bytes(self) -> int:
        """The chunk size of every pull over UCX on this link (D cuts its plan at it, P admits
        only it): the piece chunk size where one was agreed, else the staging size."""
        return self.piece_chunk_bytes or self.chunk_bytes


@dataclass
class DirectAccess:
    """D side of a direct link: P's pools opened here, and P's lease board."""

    data_path: str  # "cuda_ipc", "host_shm" or "local"
    rows: dict[str, torch.Tensor]
    board: LeaseBoardView
    # Prepared copy launches from P's pools into ours, by (P's pool, our pool): made on first use
    # (transfer/direct_copy.py).
    copies: dict[tuple[str, str], Any] = field(default_factory=dict)
    # Their C launches (DirectCopier.start_pages): made on the first read, False if unservable.
    route: Any = None
    # Our done board for this link, when P opened it (a read that succeeded is posted there).
    done: DoneBoard | None = None


# D side: P's HelloReply -> its pools and board opened here, or None to stay on UCX.
OpenDirect = Callable[[HelloReply], Awaitable[DirectAccess | None]]


class PeerLink:
    def __init__(
        self,
        channel: ControlChannel,
        endpoint: Any,
        info: PeerInfo,
        name: str,
        rendezvous_bytes: int | None = None,
    ) -> None:
        """``rendezvous_bytes``: UcxRuntime.rendezvous_bytes (None: never send piece lists)."""
        self.channel = channel
        self.endpoint = endpoint
        self.info = info
        self.name = name
        self.closed_reason: str | None = None
        # D side of a direct link: P's pools and lease board, opened in this process.
        self.access: DirectAccess | None = None
        # P side: the peer's done board, mapped here (done_board.py).
        self.done: DoneBoardView | None = None
        self._on_closed: list[Callable[[str], None]] = []
        # UCP requests of piece-list messages in flight: ``abort`` cancels them (a receive is the
        # worker's, so the endpoint's close would not end it, as it ends ucxx's own requests).
        self._iov: IovOps | None = None
        self._iov_pending: set[int] = set()
        # Whether piece-list sends may go on this endpoint yet: UCX 1.21 never completes an IOV
        # send that is the endpoint's first rendezvous (openucx/ucx#6872, the request replayed
        # wrongly after wireup); once a contiguous rendezvous send has completed, they work. P
        # stages its chunks until then (``send_data`` sets it).
        self.piece_sends_ok = False
        self._rendezvous_bytes = rendezvous_bytes
        loop = asyncio.get_running_loop()
        # UCX calls this from its progress thread when the endpoint fails (peer died).
        endpoint.set_close_callback(
            lambda: loop.call_soon_threadsafe(self.abort, "UCX endpoint to peer failed")
        )

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def start(self, on_message: Callable[[Message], None]) -> None:
        self.channel.start(on_message, lambda reason: self.abort(f"control connection: {reason}"))

    def add_close_listener(self, fn: Callable[[str], None]) -> None:
        self._on_closed.append(fn)

    def remove_close_listener(self, fn: Callable[[str], None]) -> None:
        if fn in self._on_closed:
            self._on_closed.remove(fn)

    async def send(self, msg: Message, timeout: float) -> None:
        if self.closed:
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        await self.channel.send(msg, timeout)

    def post(self, msg: Message) -> None:
        """ControlChannel.post on this link (loop thread only); on a closed link the message is
        dropped, which only delays the peer until its lease expires."""
        try:
            if self.closed:
                raise ChannelClosed(f"{self.name}: {self.closed_reason}")
            self.channel.post(msg)
        except ChannelClosed as e:
            log.info("%s not sent (%s)", type(msg).__name__, e)

    async def send_data(self, buf: torch.Tensor, tag: int) -> None:
        await self.endpoint.send(_ucx_buffer(buf), tag=tag, force_tag=True)
        nbytes = buf.numel() * buf.element_size()
        if self._rendezvous_bytes is not None and nbytes >= self._rendezvous_bytes:
            self.piece_sends_ok = True

    async def recv_data(self, buf: torch.Tensor, tag: int) -> None:
        await self.endpoint.recv(_ucx_buffer(buf), tag=tag, force_tag=True)

    async def send_pieces(self, iov: IovOps, pieces: list[tuple[int, int]], tag: int) -> None:
        """One message of host ``pieces`` (transfer/ucp_iov.py) to the peer."""
        if self.closed:  # (an aborted link's UCP endpoint is gone: never post on it)
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        self._iov = iov
        await iov.send(self.endpoint.ucp_endpoint, pieces, tag, self._iov_pending)

    async def recv_pieces(self, iov: IovOps, pieces: list[tuple[int, int]], tag: int) -> None:
        """Receive one message from the peer into host ``pieces``; ``abort`` ends it."""
        if self.closed:
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        self._iov = iov
        await iov.recv(pieces, tag, self._iov_pending)

    def abort(self, reason: str) -> None:
        """Close everything now; requests posted on the endpoint complete with an error."""
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        # Reads in flight hold their own references to P's rows; the board stays mapped until
        # the last of them lets go of it.
        self.access = None
        log.info("%s: closing link (%s)", self.name, reason)
        self.channel.close(reason)
        if self._iov is not None:
            self._iov.cancel(self._iov_pending)
        try:
            self.endpoint.abort()
        except Exception:  # already torn down by UCX
            log.debug("%s: endpoint abort failed", self.name, exc_info=True)
        for fn in list(self._on_closed):
            fn(reason)


def _ucx_buffer(buf: torch.Tensor) -> Any:
    # ucxx takes host memory through the buffer protocol and device memory through
    # __cuda_array_interface__ (which torch CUDA tensors have).
    return buf.numpy() if buf.device.type == "cpu" else buf


def check_compatible(ours: PageTable, theirs: PageTable) -> str:
    """ "" if the two tables may exchange KV, else the reason they may not."""
    if ours.compat_hash == theirs.compat_hash:
        try:  # (equal hashes, and still no pull could map: two pools with the same roles, say)
            match_pools(ours, theirs)
            match_pools(theirs, ours)
        except MapperError as e:
            return f"the page tables cannot be mapped onto each other: {e}"
        return ""
    return (
        f"compatibility hash mismatch: ours {ours.compat_hash} (model {ours.model!r}), "
        f"peer {theirs.compat_hash} (model {theirs.model!r})"
    )


async def connect(
    runtime: UcxRuntime,
    host: str,
    port: int,
    hello: Hello,
    timeout: float,
    counters: TransferCounters,
    open_direct: OpenDirect | None = None,
    done: DoneBoard | None = None,
    primer: PrimerReceive | None = None,
) -> PeerLink:
    """D side: open the control connection, exchange Hello/HelloReply, connect UCX, and with
    ``open_direct`` try P's pools for direct reads; ``done`` is the done board ``hello`` names,
    kept in the link's access when P opened it; ``primer`` the receive of the primer ``hello``
    names (primer.py), awaited when P says it sent it (the caller cancels it otherwise). Raises
    PeerRefused, or ConnectionError/TimeoutError when P cannot be reached within ``timeout``
    (the whole handshake)."""
    async with asyncio.timeout(timeout):  # the whole handshake
        name = f"link to {host}:{port}"
        reader, writer = await asyncio.open_connection(host, port)
        channel = ControlChannel(reader, writer, name, counters)
        try:
            await channel.send(hello, timeout)  # (inside connect's deadline for the whole)
            reply = await channel.receive(timeout)
            if not isinstance(reply, HelloReply):
                raise PeerRefused(f"{name}: expected HelloReply, got {type(reply).__name__}")
            problem = (
                f"peer refused us: {reply.error}"
                if reply.error
                else check_compatible(hello.page_table, reply.page_table)
            )
            if problem:
                counters.refused_peers += 1
                raise PeerRefused(f"{name}: {problem}")
            bad_address = ucx_address_problem(reply.ucx_address)
            if bad_address:
                counters.refused_peers += 1
                raise PeerRefused(f"{name}: {bad_address}")
            try:
                endpoint = await runtime.create_endpoint(reply.ucx_address)
            except (asyncio.TimeoutError, ConnectionError):
                raise
            except Exception as e:  # ucxx's own errors: an address UCX could not use
                raise PeerRefused(f"{name}: UCX endpoint to the peer failed: {e!r}") from None
            try:
                direct = None
                if open_direct is not None and reply.pool_export:
                    direct = await open_direct(reply)
                if direct is not None and reply.done_board_open:
                    direct.done = done
                piece = 0
                if primer is not None and reply.piece_chunk_bytes > 0:
                    await primer.arrived()  # (P waited for it to complete: here already)
                    piece = min(hello.piece_chunk_bytes, reply.piece_chunk_bytes)
            except BaseException:
                endpoint.abort()
                raise
        except BaseException:
            channel.close("handshake failed")
            raise
        info = PeerInfo(
            reply.instance_id, reply.page_table, min(hello.chunk_bytes, reply.chunk_bytes), piece
        )
        path = direct.data_path if direct is not None else "ucx"
        link = PeerLink(
            channel,
            endpoint,
            info,
            f"{name} (instance {reply.instance_id}, {path})",
            runtime.rendezvous_bytes,
        )
        link.access = direct
        return link


async def accept(
    runtime: UcxRuntime,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    own: HelloReply,
    timeout: float,
    counters: TransferCounters,
) -> PeerLink | None:
    """P side: answer one incoming Hello with ``own``, mapping the peer's done board when it
    names one and ``own`` offers direct reads (``link.done``), and sending the primer it asks
    for when ``own.piece_chunk_bytes`` says we list host pages (primer.py). Returns None (after
    telling the peer why) when the peer is refused or the handshake fails."""
    peername = writer.get_extra_info("peername")
    channel = ControlChannel(reader, writer, f"link from {peername}", counters)
    try:
        hello = await channel.receive(timeout)
        if not isinstance(hello, Hello):
            raise PeerRefused(f"expected Hello, got {type(hello).__name__}")
        problem = check_compatible(own.page_table, hello.page_table) or ucx_address_problem(
            hello.ucx_address
        )
        if problem:
            counters.refused_peers += 1
            await channel.send(_refusal(own, problem), timeout)
            raise PeerRefused(problem)
        endpoint = await asyncio.wait_for(runtime.create_endpoint(hello.ucx_address), timeout)
        done = None
        try:
            primed = wants_primer(hello, own.piece_chunk_bytes, runtime.rendezvous_bytes)
            if primed:  # (a quarter of the deadline: D's began earlier and covers the reply too)
                primed = await send_primer(
                    endpoint, hello.primer_bytes, hello.primer_tag, timeout / 4
                )
            done = _open_done(hello.done_board, channel.name) if own.pool_export else None
            reply = dataclasses.replace(
                own,
                done_board_open=done is not None,
                piece_chunk_bytes=own.piece_chunk_bytes if primed else 0,
            )
            await channel.send(reply, timeout)
        except BaseException:
            if done is not None:
                done.close()
            endpoint.abort()
            raise
    except Exception as e:  # refused, unreachable, or an address ucxx could not use
        log.warning("%s: handshake refused or failed: %r", channel.name, e)
        channel.close(f"handshake failed: {e!r}")
        return None
    info = PeerInfo(
        hello.instance_id,
        hello.page_table,
        min(hello.chunk_bytes, own.chunk_bytes),
        min(hello.piece_chunk_bytes, own.piece_chunk_bytes) if primed else 0,
    )
    link = PeerLink(
        channel,
        endpoint,
        info,
        f"link from {peername} (instance {hello.instance_id})",
        runtime.rendezvous_bytes,
    )
    link.piece_sends_ok = primed  # (the primer was this endpoint's first rendezvous)
    link.done = done
    return link


def ucx_address_problem(theirs: bytes) -> str:
    """Why a peer's UCX worker address must not be handed to UCX, or "". UCX parses it on trust
    and aborts the whole process on a header it does not expect (an assertion, not an error): the
    low 4 bits of the first byte are the address format, v1 (0) or v2 (1, UCX_ADDRESS_VERSION=v2),
    the high 4 bits flags or a release number. Anything else, or an address no longer than its
    header, is refused here. (Garbage past the header makes UCX fail the endpoint: an error.)"""
    if len(theirs) < _UCX_ADDRESS_MIN_BYTES:
        return f"the peer's UCX worker address is {len(theirs)} bytes, too short to be one"
    if theirs[0] & 0x0F not in _UCX_ADDRESS_FORMATS:
        return (
            f"the peer's UCX worker address has format {theirs[0] & 0x0F}, which this UCX does "
            f"not read (it reads {sorted(_UCX_ADDRESS_FORMATS)})"
        )
    return ""


_UCX_ADDRESS_MIN_BYTES = 9  # the header byte and the 64-bit worker id that follows it
_UCX_ADDRESS_FORMATS = frozenset({0, 1})  # ucp/wireup/address.c: v1 and v2


def _open_done(path: str, name: str) -> DoneBoardView | None:
    if not path:
        return None
    try:
        return DoneBoardView(path)
    except DoneBoardUnavailable as e:  # another host, say: the peer then sends ReadDone
        log.info("%s: not reading the peer's done board (%s)", name, e)
        return None


def _refusal(own: HelloReply, problem: str) -> HelloReply:
    return dataclasses.replace(
        own, error=problem, pool_export=b"", lease_board="", piece_chunk_bytes=0
    )
