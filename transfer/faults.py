"""FaultInjector: which pulls fail on purpose, and where (``transfer.fault_injection``).

The choice is a pure function of the seed and the request id, so both ends of a pull agree on it
without a message, and a rerun with the same seed and request ids fails the same requests (the
HTTP server's ids end in a unique tail: there a rerun fails a like share of other requests). Each end acts only on
its own points, where the real transport fails and its ordinary failure handling takes over:

- ``connect`` (D): the pull fails where connecting to P fails; P's lease later expires.
- ``before_data`` (P): P refuses the admitted pull before its first byte and releases the lease.
- ``mid_data`` (D): about half of the pages land (over UCX, the first half of the chunks: all of
  a one-chunk pull), then D fails the pull, also a pull with nothing to move (over UCX the chunks
  already asked for still arrive and are dropped: UCX cancels one receive only by closing its
  endpoint).
- ``before_ack`` (D): every page landed and was checked; D fails the pull instead of acking it.
"""

from __future__ import annotations

import hashlib

from transfer.config import FaultInjection

D_POINTS = frozenset({"connect", "mid_data", "before_ack"})
P_POINTS = frozenset({"before_data"})


class FaultInjector:
    def __init__(self, config: FaultInjection) -> None:
        self.config = config

    def point(self, request_id: str) -> str | None:
        """Where the pull of ``request_id`` fails, or None (the same answer on both ends)."""
        cfg = self.config
        if cfg.fraction <= 0.0:
            return None
        digest = hashlib.blake2b(f"{cfg.seed}\0{request_id}".encode(), digest_size=16).digest()
        if int.from_bytes(digest[:8], "little") / 2**64 >= cfg.fraction:
            return None
        return cfg.points[int.from_bytes(digest[8:], "little") % len(cfg.points)]

    def at(self, request_id: str, point: str) -> bool:
        """Whether the pull of ``request_id`` fails at ``point``."""
        return self.point(request_id) == point


def injected(point: str) -> str:
    """The error an injected fault leaves in the pull's result."""
    return f"injected fault at {point} (transfer.fault_injection)"
