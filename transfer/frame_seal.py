"""FrameSeal: the MAC on every control frame after the handshake's proofs, and the link's data tags.

The proofs (handshake.py) show that each side holds the cluster secret, but they cover the
handshake's transcript alone: someone in the middle of the TCP connection could pass them through
and then rewrite what follows (D's UCX address in the Join, so that P sends the prompt's KV there;
P's pool export; a later pull or notice). So both sides derive keys for the link from the secret
and the transcript, and each frame after the proofs carries a MAC over its direction, its place in
that direction's sequence and its bytes: a frame forged, altered, replayed, reordered or reflected
fails to open, and the channel closes (a frame dropped is found when a later one arrives; a
stream cut short only by the deadlines). It authenticates, it does not encrypt: an eavesdropper
still reads the frames (handshake.py says what else it does not do).

UCX itself authenticates nothing: a process that reaches D's UCX worker could send a message on a
tag D is receiving on and write into D's pages. Tags are therefore keyed too (``data_tag``):
without the secret, a tag is a 64-bit guess, even for one who reads the pull ids off the control
channel (one who sees the data path's own traffic sees the tags, used once each).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAC_BYTES = 16  # a truncated HMAC-SHA256: forging one is a 2^-128 guess per try
_SEQ = struct.Struct("!Q")
_TAG_INPUT = struct.Struct("!QI")


class ForgedFrame(ConnectionError):
    """A frame whose MAC does not check: the connection can no longer be trusted."""


def link_key(secret: bytes, purpose: bytes, transcript: bytes) -> bytes:
    """A key for one link and one ``purpose``, from the secret and the handshake's transcript
    (both instance ids and both fresh nonces: handshake.transcript)."""
    return hmac.digest(secret, b"duet link " + purpose + b"\0" + transcript, "sha256")


class FrameSeal:
    """One side's MAC state: ``seal`` what it sends, ``open`` what it receives, each direction
    with its own label and its own count (so a frame cannot be reflected back, nor replayed)."""

    def __init__(self, key: bytes, sends: bytes, receives: bytes) -> None:
        self._key = key
        self._sends = sends
        self._receives = receives
        self._sent = 0
        self._received = 0

    def seal(self, data: bytes) -> bytes:
        mac = self._mac(self._sends, self._sent, data)
        self._sent += 1
        return data + mac

    def open(self, sealed: bytes) -> bytes:
        """The frame's bytes without its MAC; raises ForgedFrame if the MAC does not check."""
        data, mac = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        if len(sealed) < MAC_BYTES or not hmac.compare_digest(
            self._mac(self._receives, self._received, data), mac
        ):
            raise ForgedFrame(f"frame {self._received} from the peer failed authentication")
        self._received += 1
        return data

    def _mac(self, direction: bytes, seq: int, data: bytes) -> bytes:
        return hmac.digest(self._key, direction + _SEQ.pack(seq) + data, "sha256")[:MAC_BYTES]


def data_tag(key: bytes, pull_id: int, chunk_index: int) -> int:
    """The 64-bit UCX tag of one data chunk of a pull: distinct per chunk and per pull (so
    concurrent pulls never match each other's chunks), and unguessable without the link's key."""
    digest = hashlib.blake2b(_TAG_INPUT.pack(pull_id, chunk_index), key=key, digest_size=8)
    return int.from_bytes(digest.digest(), "big")
