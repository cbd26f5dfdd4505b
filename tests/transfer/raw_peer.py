"""A peer that speaks the control protocol over a plain blocking socket: what a misbehaving or
unauthenticated worker can (and cannot) get out of a real transceiver, and a prefill worker that
answers pulls as a test tells it to."""

from __future__ import annotations

import socket
import struct

from transfer.control import frame, frame_bytes
from transfer.frame_seal import FrameSeal, link_key
from transfer.handshake import proof, transcript
from transfer.messages import (
    Challenge,
    Hello,
    Join,
    Message,
    Ready,
    Refused,
    Welcome,
    decode_message,
)
from transfer.page_table import PageTable


class PeerClosed(ConnectionError):
    """The other side closed the connection (not: a frame that failed to open, ForgedFrame)."""


def read_frame(sock: socket.socket) -> bytes:
    header = sock.recv(4, socket.MSG_WAITALL)
    if len(header) < 4:
        raise PeerClosed("the peer closed the connection")
    (size,) = struct.unpack("!I", header)
    return sock.recv(size, socket.MSG_WAITALL)


class RawPeer:
    """The decode side of a handshake with a real KVSender, step by step."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.received: list[bytes] = []  # every frame the sender sent us, as it came
        self.seal: FrameSeal | None = None  # (from the Challenge on)

    def send(self, msg: Message) -> None:
        self.sock.sendall(frame(msg, self.seal))

    def send_raw(self, payload: bytes) -> None:
        self.sock.sendall(frame_bytes(payload, self.seal))

    def recv(self) -> Message:
        data = read_frame(self.sock)
        self.received.append(data)
        if self.seal is not None:
            data = self.seal.open(data)  # (ForgedFrame if it fails: never taken as a close)
        return decode_message(data)

    def handshake(
        self, secret: bytes, table: PageTable, ucx_address: bytes, path: str = "ucx"
    ) -> Message | None:
        """Hello, Challenge, Join with our proof, sealed with ``secret``; returns P's answer
        (Welcome or Refused, None when P closed the connection instead), and on a Welcome says
        Ready(``path``): the data path we claim to have opened."""
        nonce = b"n" * 32
        self.send(Hello("raw-peer", nonce))
        challenge = self.recv()
        assert isinstance(challenge, Challenge)
        said = transcript("raw-peer", nonce, challenge.instance_id, challenge.nonce)
        self.seal = FrameSeal(link_key(secret, b"control", said), b"D", b"P")
        self.send(Join(proof(secret, b"D", said), table, ucx_address))
        try:
            answer = self.recv()
        except PeerClosed:
            return None
        if isinstance(answer, Welcome):
            self.send(Ready(path))
        return answer

    def closed_by_peer(self) -> bool:
        """True once the other side closed the connection with nothing more sent; False when a
        byte comes, or nothing within the socket's timeout."""
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        self.sock.close()


class RawServer:
    """The prefill side of a handshake, for a decode worker: authenticates with ``secret`` and
    welcomes it with ``table``; the test then answers its messages itself."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conn: socket.socket | None = None
        self.seal: FrameSeal | None = None

    def accept(
        self, secret: bytes, table: PageTable, ucx_address: bytes, claim: str = "rogue"
    ) -> Message:
        """``claim``: the instance id our Challenge names; our proof is over "rogue" (another
        id claimed: what someone in the middle renaming this worker would send)."""
        conn, _ = self.server.accept()
        conn.settimeout(30)
        self.conn = conn
        hello = self.recv()
        assert isinstance(hello, Hello)
        nonce = b"p" * 32
        said = transcript(hello.instance_id, hello.nonce, "rogue", nonce)
        self.send(Challenge(claim, nonce, proof(secret, b"P", said)))
        self.seal = FrameSeal(link_key(secret, b"control", said), b"P", b"D")
        join = self.recv()
        if not isinstance(join, Join):
            return join
        self.send(Welcome(table, ucx_address, b""))
        return self.recv()  # Ready

    def send(self, msg: Message) -> None:
        assert self.conn is not None
        self.conn.sendall(frame(msg, self.seal))

    def send_raw(self, payload: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(frame_bytes(payload, self.seal))

    def recv(self) -> Message:
        assert self.conn is not None
        data = read_frame(self.conn)
        return decode_message(self.seal.open(data) if self.seal is not None else data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


__all__ = ["PeerClosed", "RawPeer", "RawServer", "Refused", "read_frame"]
