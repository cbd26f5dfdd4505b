"""Prestager: the prefill side gathers a published request's first staged chunk before D asks.

Without it, a UCX pull's first chunk is gathered only once the PullRequest has arrived, and nothing
hides that copy: the wire stays idle until it ends (1-2.5 ms of a 16 MiB pull on the CPU,
docs/benchmarks/transfer.md). The plan's chunk 0 holds the first bytes of the ticket's pages in
stream order whatever D's pages are (plan.py: fragments in pool then page order, cut in order), so
P can gather them at publish time, while the ticket travels to the decode worker. The serving
session sends that buffer when its chunk 0 is exactly those source bytes, compared range by range,
and gathers as usual otherwise (D skips cached pages, a run long enough to go straight, another
chunk size).

A prestaged buffer belongs to one lease (the Lease object, not the request id: a request id can be
published again over the same pages with other bytes once its lease ended), and a session takes it
only for that lease. It runs only while some peer pulls over UCX (a decode worker that reads P's
pools directly never needs it), and at most half of the staging buffers are out for it at a time,
held or taken by a session that has not sent them yet, so serving pulls keep the other half. A
buffer goes back once its gather has ended: when the session has sent it, when the pull did not
credit chunk 0 at once (it would sit pinned), when the lease ends (direct read, expiry, cancel) or
at close. (So a lease that is read directly or never pulled keeps its buffer until it ends, at
most ``lease_s``: pulls that find no prestaged chunk then have the other half.) Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from transfer.leases import Lease, LeaseState
from transfer.mapper import MapperError
from transfer.plan import Chunk, build_plan
from transfer.staging import gather_chunk

if TYPE_CHECKING:
    from transfer.sender import KVSender

log = logging.getLogger(__name__)

Ranges = tuple[tuple[str, int, int], ...]  # (source pool, byte offset, bytes), merged


@dataclass
class Prestaged:
    lease: Lease  # the publish it was gathered for
    buf: torch.Tensor
    ranges: Ranges  # (equal ranges: equal bytes, in the same order)
    gather: asyncio.Future[None]  # never cancelled: its end means the copy thread is done with buf

    async def ready(self) -> bool:
        """Wait for the gather; False if it failed (the caller then gathers itself)."""
        try:
            await asyncio.shield(self.gather)
        except Exception:
            log.warning("prestaging a chunk failed; it is gathered again", exc_info=True)
            return False
        return True


def source_ranges(chunk: Chunk) -> Ranges:
    """The chunk's source bytes in wire order, adjacent runs merged: two chunks with the same
    ranges put the same bytes in a staging buffer."""
    out: list[list] = []
    for f in chunk.fragments:
        last = out[-1] if out else None
        if last is not None and last[0] == f.src_pool and last[1] + last[2] == f.src_offset:
            last[2] += f.nbytes
        else:
            out.append([f.src_pool, f.src_offset, f.nbytes])
    return tuple((pool, offset, nbytes) for pool, offset, nbytes in out)


class Prestager:
    def __init__(self, sender: KVSender) -> None:
        self.s = sender
        self.limit = sender.staging.max_buffers // 2
        self._held: dict[str, Prestaged] = {}
        self._out = 0  # buffers taken from staging and not given back (held or in a session)
        self._closed = False

    def __len__(self) -> int:
        return len(self._held)

    @property
    def out(self) -> int:
        return self._out

    def offer(self, request_id: str, pages: Mapping[str, Sequence[int]], chunk_bytes: int) -> None:
        """Gather ``request_id``'s first chunk, cut at ``chunk_bytes`` (a UCX puller's agreed
        chunk size, at most our staging buffer's), now, if the request is still waiting for its
        pull, needs staging, and a buffer is to spare."""
        s = self.s
        lease = s.leases.get(request_id)
        if lease is None or lease.state is not LeaseState.PUBLISHED or lease.page_ids != pages:
            return
        old = self._held.get(request_id)
        if old is not None:
            if old.lease is lease:
                return
            self.drop(old.lease)  # an earlier publish of this request id: not these bytes
        if self._closed or self._out >= self.limit:
            return
        chunk = self._first_chunk(pages, min(chunk_bytes, s.staging.buffer_bytes))
        if chunk is None or s.moves_straight(chunk, source=True):  # nothing to stage
            return
        buf = s.staging.try_acquire()
        if buf is None:
            return
        self._out += 1
        gather = asyncio.ensure_future(
            s.runtime.copy(gather_chunk, chunk, s.rows, buf[: chunk.nbytes])
        )
        self._held[request_id] = Prestaged(lease, buf, source_ranges(chunk), gather)

    def _first_chunk(self, pages: Mapping[str, Sequence[int]], size: int) -> Chunk | None:
        """Chunk 0 of a plan from these pages to any others: only the first pages of each pool
        can be in it, so only those are mapped (onto themselves)."""
        table = self.s.page_table
        head = {p.name: list(pages[p.name][: size // p.page_bytes + 1]) for p in table.pools}
        try:
            plan = build_plan(table, table, head, head, size)
        except (MapperError, ValueError):
            return None  # the pull will say what is wrong with these pages
        return plan.chunks[0] if plan.chunks else None

    def take(self, lease: Lease, chunk: Chunk, credited: bool) -> Prestaged | None:
        """The buffer prestaged for ``lease`` if it holds ``chunk``'s bytes and the pull credited
        that chunk at once (``credited``); any other buffer of that request goes back. The caller
        gives the one it got back with ``give_back``."""
        held = self._held.pop(lease.request_id, None)
        if held is None:
            return None
        if held.lease is lease and credited and held.ranges == source_ranges(chunk):
            return held
        self.give_back(held)
        return None

    def drop(self, lease: Lease) -> None:
        """``lease`` ended: its buffer goes back (once its gather has ended)."""
        held = self._held.get(lease.request_id)
        if held is not None and held.lease is lease:
            del self._held[lease.request_id]
            self.give_back(held)

    def give_back(self, held: Prestaged) -> None:
        """``held``'s buffer back to staging once its gather has ended (it counts as out until
        then)."""
        if held.gather.done():
            self._release(held.buf)
        else:
            held.gather.add_done_callback(lambda _: self._release(held.buf))

    def _release(self, buf: torch.Tensor) -> None:
        self._out -= 1
        self.s.staging.release(buf)

    async def close(self, timeout: float) -> None:
        """Every buffer back, once the gathers in flight have ended (at most ``timeout``); no
        offers after this."""
        self._closed = True
        held, self._held = list(self._held.values()), {}
        pending = [h.gather for h in held if not h.gather.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for h in held:
            self.give_back(h)
