"""ControlChannel: the TCP connection that carries one peer pair's control messages.

Why TCP and not a UCX listener: ucxx's listener cannot be bound to one address (it listens on every
interface), and every socket here binds to the configured host (127.0.0.1 locally). So the listener
is a plain asyncio TCP server on that host; the bulk KV bytes go over UCX endpoints created from the
worker addresses the peers exchange in Hello/HelloReply.

Frames: a 4-byte big-endian length, then one msgpack message (messages.py). A frame that does not
decode is answered with Reject and skipped; the connection stays usable. A length above
MAX_FRAME_BYTES leaves no way to find the next frame, so it closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

from transfer.messages import Message, Reject, TransferProtocolError, decode_message, encode_message
from transfer.stats import TransferCounters

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20
_HEADER = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The control connection is gone (peer closed it, it broke, or we closed it)."""


class FrameTooLarge(ValueError):
    """A message of ours would not fit a frame: the peer would close the connection on it (and
    every transfer on it with it), so it is not sent."""


def _frame(msg: Message) -> bytes:
    data = encode_message(msg)
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"{type(msg).__name__} of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit"
        )
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
        self._task: asyncio.Task | None = None

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    async def send(self, msg: Message, timeout: float) -> None:
        """Write one message; raises ChannelClosed if the connection is gone or the write stalls."""
        if self.closed:
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        if self.writer.is_closing():
            self.close("connection lost")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        self.writer.write(_frame(msg))
        transport = self.writer.transport
        if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]:
            return  # not paused: drain() would return at once, after wait_for's extra task
        try:
            await asyncio.wait_for(self.writer.drain(), timeout)
        except asyncio.TimeoutError:
            self.close(f"sending {type(msg).__name__} stalled for {timeout}s")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}") from None
        except (ConnectionError, OSError) as e:
            self.close(f"connection lost ({e})")
            raise ChannelClosed(f"{self.name}: {self.closed_reason}") from None

    def post(self, msg: Message) -> None:
        """Write one small message without waiting for the write buffer to drain (loop thread
        only). For notices that nobody waits on, such as ReadDone: a lost one only delays the
        peer until a lease expires. Raises ChannelClosed if the connection is gone."""
        if self.closed or self.writer.is_closing():
            raise ChannelClosed(f"{self.name}: {self.closed_reason or 'closing'}")
        self.writer.write(_frame(msg))

    async def receive(self, timeout: float) -> Message:
        """Read the next well-formed message (the handshake; afterwards ``start`` owns the reader).
        Malformed ones are rejected as in ``start``. Raises ChannelClosed or TimeoutError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            data = await asyncio.wait_for(self._read_frame(), max(0.0, deadline - loop.time()))
            try:
                return decode_message(data)
            except TransferProtocolError as e:
                self._reject(e)

    def start(
        self, on_message: Callable[[Message], None], on_closed: Callable[[str], None]
    ) -> None:
        """Read messages in the background until the connection ends. Malformed messages are
        counted, answered with Reject, and also handed to ``on_message`` as a Reject (so a transfer
        named by the bad message can fail at once)."""
        self._task = asyncio.ensure_future(self._read_loop(on_message, on_closed))

    async def _read_loop(
        self, on_message: Callable[[Message], None], on_closed: Callable[[str], None]
    ) -> None:
        try:
            while True:
                data = await self._read_frame()
                try:
                    msg = decode_message(data)
                except TransferProtocolError as e:
                    self._reject(e)
                    on_message(
                        Reject(e.request_id or "", f"peer sent a malformed message: {e.reason}")
                    )
                    continue
                on_message(msg)
        except ChannelClosed:
            pass
        except Exception as e:  # a bug in a handler must not leave the peer waiting forever
            log.exception("%s: control reader failed", self.name)
            self.close(f"control reader failed: {e}")
        on_closed(self.closed_reason or "closed")

    def _reject(self, e: TransferProtocolError) -> None:
        self.counters.rejected_messages += 1
        log.warning("%s: rejected a malformed message: %s", self.name, e.reason)
        asyncio.ensure_future(
            self._send_quietly(Reject(e.request_id or "", f"malformed message: {e.reason}"))
        )

    async def _send_quietly(self, msg: Message) -> None:
        try:
            await self.send(msg, timeout=5.0)
        except (ChannelClosed, FrameTooLarge):  # (a Reject naming a huge request id)
            pass

    async def _read_frame(self) -> bytes:
        try:
            header = await self.reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_FRAME_BYTES:
                self.close(f"peer sent a {size}-byte frame (limit {MAX_FRAME_BYTES})")
                raise ChannelClosed(self.closed_reason)
            return await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self.close(
                "peer closed the connection"
                if isinstance(e, asyncio.IncompleteReadError)
                else str(e)
            )
            raise ChannelClosed(self.closed_reason) from None

    def close(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
        if not self.writer.is_closing():
            self.writer.close()
