"""The primer: one contiguous UCX message P sends on a new endpoint to D, so that P may send piece
lists (ucp_iov.py) on it from the first chunk.

UCX 1.21 never completes an IOV send that is an endpoint's first rendezvous (openucx/ucx#6872, the
request replayed wrongly after wireup); once a contiguous rendezvous send has completed on the
endpoint, IOV sends work. Without the primer, P stages a link's chunks until one of its own
contiguous sends has done that (PeerLink.piece_sends_ok), so the link's chunks must fit a staging
buffer. With it, a link whose two sides list host pages takes larger chunks
(``piece_chunk_bytes``): on a few cores each UCX message costs wake-ups of several threads on both
sides (docs/benchmarks/transfer.md, seventeenth pass).

The handshake: D posts the receive, then names its tag and size in Hello; P, when it lists host
pages too and the size is a rendezvous for it, sends the primer and waits for it to complete before
its HelloReply says so; D cancels the receive when the reply says P did not send it. Its bytes mean
nothing: every primer of a process sends from or receives into the same scratch memory, never freed
(UCP may still use it after its waiter gave up).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import numpy as np

from transfer.ucp_iov import IovOps

log = logging.getLogger(__name__)

# The largest primer P sends when D asks (D asks for its UCX rendezvous threshold: 256 KiB unless
# the user raised it): a hostile or broken Hello must not make P allocate much.
MAX_PRIMER_BYTES = 16 << 20

# Scratch buffers by size, powers of two, never freed: at most about 2 x MAX_PRIMER_BYTES in all.
_SCRATCH: dict[int, np.ndarray] = {}


def scratch(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of the process's primer scratch memory (kept for the process)."""
    size = 1 << max(0, nbytes - 1).bit_length()
    buf = _SCRATCH.get(size)
    if buf is None:
        buf = _SCRATCH[size] = np.zeros(size, dtype=np.uint8)
    return buf[:nbytes]


class PrimerReceive:
    """D side: the posted receive of one link's primer."""

    def __init__(self, iov: IovOps, nbytes: int) -> None:
        self.tag = secrets.randbits(63)  # (a Hello field: a non-negative int64)
        self.nbytes = nbytes
        buf = scratch(nbytes)
        self._task = asyncio.ensure_future(iov.recv([(buf.ctypes.data, nbytes)], self.tag, set()))
        # (a cancelled primer ends with an error nobody awaits)
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def arrived(self) -> None:
        """Wait for the primer P said it sent (the caller bounds the wait)."""
        await asyncio.shield(self._task)

    def cancel(self) -> None:
        """End the receive (P did not send the primer, or the handshake failed): a receive not
        posted yet never is; a posted one is cancelled in UCP (ucp_iov.IovOps)."""
        self._task.cancel()


def wants_primer(hello: Any, own_piece_chunk_bytes: int, rendezvous_bytes: int | None) -> bool:
    """P side: whether to send the primer ``hello`` asks for. Both sides must list host pages, and
    the primer must be a rendezvous here (at least ``rendezvous_bytes``; None: the threshold is
    unknown, so no) and no larger than MAX_PRIMER_BYTES."""
    return (
        own_piece_chunk_bytes > 0
        and hello.piece_chunk_bytes > 0
        and rendezvous_bytes is not None
        and rendezvous_bytes <= hello.primer_bytes <= MAX_PRIMER_BYTES
    )


async def send_primer(endpoint: Any, nbytes: int, tag: int, timeout: float) -> bool:
    """P side: send the primer on ``endpoint`` (a ucxx endpoint) and wait until it completed;
    False when it failed or did not complete within ``timeout``, a part of the handshake's
    deadline: the link then stages its first chunks, as without a primer. (A send that timed
    out stays on the endpoint until the link closes: it reads scratch memory only.)"""
    try:
        await asyncio.wait_for(endpoint.send(scratch(nbytes), tag=tag, force_tag=True), timeout)
    except Exception as e:  # a timeout, or ucxx's own error types
        log.warning(
            "primer of %d bytes not sent (%r): this link stages its first chunks", nbytes, e
        )
        return False
    return True
