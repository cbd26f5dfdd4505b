"""ControlChannel: the TCP connection that carries one peer pair's control messages.

Why TCP and not a UCX listener: ucxx's listener cannot be bound to one address (it listens on every
interface), and every socket here binds to the configured host (127.0.0.1 locally). So the listener
is a plain asyncio TCP server on that host; the KV bytes go over the data path of the link.

Frames: a 4-byte big-endian length, then one msgpack message (messages.py). A frame that does not
decode is counted, answered with Reject and skipped: the connection stays usable. A length above
MAX_FRAME_BYTES leaves no way to find the next frame, so it closes the connection. Until the peer
has proven the cluster secret the limit is HANDSHAKE_FRAME_BYTES (``max_frame_bytes``): a peer
without it could otherwise make each side read and decode 16 MiB frames on the worker's event
loop (seconds of decoding, a GiB of memory), connection after connection.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

from transfer.frame_seal import MAC_BYTES, ForgedFrame, FrameSeal
from transfer.messages import Message, Reject, TransferProtocolError, decode_message, encode_message
from transfer.stats import TransferCounters

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20
# The handshake's messages hold instance ids, nonces, proofs, a page table (a few pool groups) and
# a UCX address (a few KiB with every transport): far below this.
HANDSHAKE_FRAME_BYTES = 256 << 10
_HEADER = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The control connection is gone (peer closed it, it broke, or we closed it)."""


class FrameTooLarge(ValueError):
    """A message of ours would not fit a frame: the peer would close the connection on it (and every
    transfer on it), so it is not sent."""


def frame(msg: Message, seal: FrameSeal | None = None) -> bytes:
    """The frame of ``msg``: its length, its bytes, and with ``seal`` their MAC."""
    data = encode_message(msg)
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"{type(msg).__name__} of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit"
        )
    return frame_bytes(data, seal)


def frame_bytes(data: bytes, seal: FrameSeal | None = None) -> bytes:
    if seal is not None:
        data = seal.seal(data)
    return _HEADER.pack(len(data)) + data


class ControlChannel:
    """Framed messages over one TCP stream. Use from the event loop thread only."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        name: str,
        counters: TransferCounters,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.name = name
        self.counters = counters  # rejected_messages counts the peer's malformed messages
        self.closed_reason: str | None = None
        self.max_frame_bytes = HANDSHAKE_FRAME_BYTES  # (MAX_FRAME_BYTES once the peer is proven)
        self.seal_sends: FrameSeal | None = None  # (set by the handshake)
        self.open_receives: FrameSeal | None = None

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    async def send(self, msg: Message, timeout: float) -> None:
        """Write one message; raises ChannelClosed if the connection is gone or the write stalls."""
        if not self.write(msg):
            await self.drain(type(msg).__name__, timeout)

    def write(self, msg: Message) -> bool:
        """Write one message now, without waiting: True when the kernel took it (the usual case),
        False when it waits in the transport's buffer above its limit (``drain`` then). Raises
        ChannelClosed if the connection is gone."""
        if self.closed or self.writer.is_closing():
            self.close(self.closed_reason or "connection lost")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        self.writer.write(frame(msg, self.seal_sends))
        transport = self.writer.transport
        return transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]

    async def drain(self, what: str, timeout: float) -> None:
        """Wait until the transport's buffer is below its limit; a stall closes the channel."""
        try:
            async with asyncio.timeout(timeout):
                await self.writer.drain()
        except TimeoutError:
            self.close(f"sending {what} stalled for {timeout}s")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}") from None
        except (ConnectionError, OSError) as e:
            self.close(f"connection lost ({e})")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}") from None

    async def receive(self, timeout: float) -> Message:
        """The next message, malformed or not (the handshake: a malformed one ends it). Raises
        ChannelClosed, TimeoutError or TransferProtocolError."""
        async with asyncio.timeout(timeout):  # (not wait_for: it may lose a cancel)
            data = self._open(await self._read_frame())
        try:
            return decode_message(data)
        except TransferProtocolError:
            self.counters.rejected_messages += 1
            raise

    async def serve(
        self, on_message: Callable[[Message], None], on_closed: Callable[[str], None]
    ) -> None:
        """Read messages until the connection ends. Malformed ones are counted, answered with
        Reject, and handed to ``on_message`` as a Reject (so a transfer the bad message named can
        fail at once)."""
        try:
            while True:
                data = self._open(await self._read_frame())
                try:
                    msg = decode_message(data)
                except TransferProtocolError as e:
                    self.counters.rejected_messages += 1
                    log.warning("%s: rejected a malformed message: %s", self.name, e.reason)
                    reason = f"malformed message: {e.reason}"
                    asyncio.ensure_future(self._send_quietly(Reject(e.request_id or "", reason)))
                    msg = Reject(e.request_id or "", f"peer sent a {reason}")
                on_message(msg)
        except ChannelClosed:
            pass
        except Exception as e:  # a bug in a handler must not leave the peer waiting forever
            log.exception("%s: control reader failed", self.name)
            self.close(f"control reader failed: {e}")
        on_closed(self.closed_reason or "closed")

    async def _send_quietly(self, msg: Message) -> None:
        try:
            await self.send(msg, timeout=5.0)
        except (ChannelClosed, FrameTooLarge):  # (a Reject naming a huge request id)
            pass

    def _open(self, data: bytes) -> bytes:
        if self.open_receives is None:
            return data
        try:
            return self.open_receives.open(data)
        except ForgedFrame as e:
            self.counters.rejected_messages += 1
            log.warning("%s: %s; closing the connection", self.name, e)
            self.close(str(e))
            raise ChannelClosed(f"{self.name}: {e}") from None

    async def _read_frame(self) -> bytes:
        try:
            (size,) = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
            if size > self.max_frame_bytes + (MAC_BYTES if self.open_receives else 0):
                self.close(f"peer sent a {size}-byte frame (limit {self.max_frame_bytes})")
                raise ChannelClosed(self.closed_reason)
            return await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            closed = isinstance(e, asyncio.IncompleteReadError)
            self.close("peer closed the connection" if closed else str(e))
            raise ChannelClosed(self.closed_reason) from None

    def close(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
        if not self.writer.is_closing():
            self.writer.close()
