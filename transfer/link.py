"""Link: one authenticated peer, i.e. its control channel, a UCX endpoint to its worker, its page
table, and the data path chosen for the pair (handshake.py makes links).

Closing a link is how a broken pair ends its transfers: ``abort`` closes the UCX endpoint, which
cancels every receive and send posted on it, and the control channel, so the peer learns at once;
transfers on the link hear it through their close listeners and fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from transfer.control import ChannelClosed, ControlChannel, FrameTooLarge
from transfer.frame_seal import data_tag
from transfer.messages import Message, Reject
from transfer.page_table import PageTable

if TYPE_CHECKING:
    from transfer.paths.base import DataPath

log = logging.getLogger(__name__)


class Link:
    def __init__(
        self,
        channel: ControlChannel,
        endpoint: Any,
        peer_instance: str,
        peer_table: PageTable,
        path: DataPath,
        name: str,
        tag_key: bytes,
        messages: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self.peer_instance = peer_instance
        self.peer_table = peer_table
        self.path = path
        self.name = f"{name} ({path.name})"
        self.closed_reason: str | None = None
        self._tag_key = tag_key  # keys the UCX tags of this link's data (frame_seal.data_tag)
        self._messages = messages  # around each data message (UcxRuntime.messages)
        self._listeners: list[Callable[[str], None]] = []
        self._reader: asyncio.Task | None = None
        loop = asyncio.get_running_loop()
        # UCX calls this from its progress thread when the endpoint fails (the peer died).
        endpoint.set_close_callback(
            lambda: loop.call_soon_threadsafe(self.abort, "UCX endpoint to the peer failed")
        )

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def start(self, on_message: Callable[[Message], None]) -> None:
        """Read the peer's messages in the background until the link closes."""
        self._reader = asyncio.ensure_future(
            self.channel.serve(on_message, lambda why: self.abort(f"control connection: {why}"))
        )

    def add_close_listener(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def remove_close_listener(self, fn: Callable[[str], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    async def send(self, msg: Message, timeout: float) -> None:
        if self.closed:
            raise ChannelClosed(f"{self.name}: {self.closed_reason}")
        await self.channel.send(msg, timeout)

    def post(self, msg: Message, timeout: float) -> None:
        """Send ``msg`` now without waiting for it (a notice nobody waits on: a lost one only
        delays the peer until a deadline). Written right here, with no task and no loop round;
        a transport over its buffer limit is drained in the background."""
        name = type(msg).__name__
        try:
            if self.closed:
                raise ChannelClosed(f"{self.name}: {self.closed_reason}")
            if self.channel.write(msg):
                return
        except (ConnectionError, FrameTooLarge) as e:
            log.info("%s not sent: %s", name, e)
            return

        async def drain() -> None:
            try:
                await self.channel.drain(name, timeout)
            except ConnectionError as e:
                log.info("%s not sent: %s", name, e)

        asyncio.ensure_future(drain())

    def data_tag(self, pull_id: int, chunk_index: int) -> int:
        return data_tag(self._tag_key, pull_id, chunk_index)

    async def send_data(self, buf: torch.Tensor, tag: int) -> None:
        with self._messages():
            await self.endpoint.send(ucx_buffer(buf), tag=tag, force_tag=True)

    async def recv_data(self, buf: torch.Tensor, tag: int) -> None:
        with self._messages():
            await self.endpoint.recv(ucx_buffer(buf), tag=tag, force_tag=True)

    def abort(self, reason: str) -> None:
        """Close everything now; UCX requests posted on the endpoint end with an error."""
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        log.info("%s: closing link (%s)", self.name, reason)
        self.channel.close(reason)
        try:
            self.endpoint.abort()
        except Exception:  # already torn down by UCX
            log.debug("%s: endpoint abort failed", self.name, exc_info=True)
        self.path.close()
        for fn in list(self._listeners):
            fn(reason)


def ucx_buffer(buf: torch.Tensor) -> Any:
    # ucxx takes host memory through the buffer protocol and device memory through
    # __cuda_array_interface__ (which torch CUDA tensors have).
    return buf.numpy() if buf.device.type == "cpu" else buf


class _LinkSession(Protocol):
    """A transfer on a link (transfer/pull.py's PullSession, transfer/serve.py's ServeSession)."""

    @property
    def link(self) -> Link | None: ...

    @property
    def request_id(self) -> str: ...

    def deliver(self, msg: Message) -> None: ...


def deliver_reject(msg: Reject, link: Link, sessions: Iterable[_LinkSession]) -> None:
    """A Reject from ``link``'s channel (the peer's message it could not read, naming the request
    it could make out: ControlChannel.serve; or the peer's Reject of ours) to the transfers of
    that request on that link, which fail at once; logged when it names none."""
    hit = [s for s in sessions if s.link is link and s.request_id == msg.request_id]
    for session in hit:
        session.deliver(msg)
    if not hit:
        log.warning("%s: %s", link.name, msg.reason)
