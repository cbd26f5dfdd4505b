"""Direct reads: D copies P's pages itself, from P's pools opened in D's process (host_shm, cuda_ipc).

A direct read holds P's lease for the read (DESIGN section 3, rule 6), in one round trip on the
control channel plus the final notice:

    D -> P  PullRequest (direct: no chunks)  P checks the ticket against its lease and the declared
                                             history, and holds the lease (it cannot expire)
    P -> D  ReadGrant                        D copies the pages, then checks it is within its time
    D -> P  TransferAck                      P releases the pages

P holds the lease for ``chunk_deadline_s + ack_deadline_s`` after its grant at most. D counts the
same span from before its request, so D's read ends (or fails) before P can let the pages go: a
read that finished later than that is failed by D, whatever it copied. (Both ends run on one
host, on one monotonic clock.)
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

import duet_kernels
from transfer.mapper import Segment, total_bytes
from transfer.messages import PullRequest, ReadGrant
from transfer.paths.base import DataPath, PullFailed
from transfer.pools import as_words, page_slice, segment_ids

if TYPE_CHECKING:
    from transfer.pull import PullSession
    from transfer.serve import ServeSession

# Per segment, its (source, destination) page ids on the copying device.
SegmentIds = Sequence[tuple[torch.Tensor, torch.Tensor]]


class DirectPath(DataPath):
    def __init__(self, peer_rows: dict[str, torch.Tensor] | None = None) -> None:
        """``peer_rows``: P's pools opened here (D side); None on P's side of the link."""
        self.peer_rows = peer_rows

    @abstractmethod
    async def copy(
        self,
        pull: PullSession,
        segments: Sequence[Segment],
        deadline: float,
        ids: SegmentIds | None = None,
    ) -> None:
        """Copy ``segments`` from P's rows into ours. Returns when the bytes are in place, or
        raises PullFailed when they are not by ``deadline`` (loop time) and nothing of the copy
        can write our pages unordered any more. ``ids``: ``prepare(segments)``'s, when it made any."""

    def prepare(self, segments: Sequence[Segment]) -> SegmentIds | None:
        """Whatever of the copy can be readied before P's grant, while the request travels (the
        page ids' upload to a GPU); None where nothing can."""
        return None

    # ---- D ----
    async def fetch(self, pull: PullSession) -> int:
        cfg, t = pull.config, pull.ticket
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.chunk_deadline_s + cfg.ack_deadline_s
        assert pull.link is not None
        # Ask first, then map the pages while P admits the pull: the mapping is off the round
        # trip that every direct read waits for (a mapping error fails the pull all the same).
        declared = pull.source_bytes()
        await pull.send(
            PullRequest(
                t.request_id,
                pull.pull_id,
                t.lease_gen,
                t.page_ids,
                pull.dst,
                pull.skip,
                pull.expected,
                [],
                declared,
                [],
            )
        )
        segments = pull.map()
        ids = self.prepare(segments)
        nbytes = total_bytes(segments)
        wait = min(cfg.pull_deadline_s, deadline - loop.time())
        _, grant = await pull.next_event(wait, "P's grant of the read")
        if not isinstance(grant, ReadGrant):
            raise PullFailed(f"expected ReadGrant, got {type(grant).__name__}")
        pull.check_declared(grant.declared_prompt_len)
        pull.chunks = 1
        if pull.fault == "mid_data":
            await self.copy(pull, [s.part(0, len(s.src_ids) // 2) for s in segments], deadline)
            pull.inject("mid_data")
        await self.copy(pull, segments, deadline, ids)
        if loop.time() > deadline:
            raise PullFailed(
                f"the read took longer than {cfg.chunk_deadline_s + cfg.ack_deadline_s}s "
                "(chunk_deadline_s + ack_deadline_s): the prefill worker may have reused the pages"
            )
        if pull.link.closed:
            raise PullFailed(
                f"the link to the prefill worker closed during the read: {pull.link.closed_reason}"
            )
        pull.r.book.bump("chunks")
        return nbytes

    # ---- P ----
    async def serve(self, pull: ServeSession) -> None:
        pull.inject("before_data")
        req, cfg = pull.request, pull.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.chunk_deadline_s + cfg.ack_deadline_s
        try:
            await pull.send(ReadGrant(req.request_id, req.pull_id, pull.lease.declared_prompt_len))
        except Exception:
            # A send that timed out may still deliver the grant (it is in the socket's buffer):
            # D may read until its read deadline, never later than ours; the pages stay till then.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise
        if not await pull.wait_for_notice(deadline - loop.time()) and pull.link.closed:
            # D may still be copying, unaware yet that the link is gone: the pages stay until
            # its read deadline has passed.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
        pull.sender.book.bump("chunks")


def copy_segments(
    segments: Sequence[Segment],
    src_rows: Mapping[str, torch.Tensor],
    dst_rows: Mapping[str, torch.Tensor],
    device: torch.device,
    ids: SegmentIds | None = None,
) -> None:
    """One page-copy kernel call per segment (the current stream on a GPU; done on return on the
    CPU). Ids go to ``device``, where the kernel reads them even when one side is a peer's memory
    (``ids``: already there, one pair per segment)."""
    for i, seg in enumerate(segments):
        src = page_slice(src_rows[seg.src_pool], seg.src_offset, seg.nbytes_per_page)
        dst = page_slice(dst_rows[seg.dst_pool], seg.dst_offset, seg.nbytes_per_page)
        src_ids, dst_ids = segment_ids(seg, device) if ids is None else ids[i]
        src, dst = as_words(src, dst)
        duet_kernels.copy_pages(src, src_ids, dst, dst_ids)
