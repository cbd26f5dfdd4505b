"""The prefill side of one pull: admission (``admit``), then a ServeSession from the lease's hold to
its release.

Admission checks a PullRequest against the request's lease: the lease's generation (a ticket of an
ended lease never gets a later publish of the request), the ticket's pages, the skips, the mapping
onto D's pages, the declared history against D's expected prompt length, and D's chunk plan. A
refusal is a PullError (counted as ``refused_pulls``); it leaves the lease alone (the right ticket
may still come), except for a declared-history mismatch, which fails the request: its pages go.
An admitted pull holds the lease (it cannot expire) until the session releases it, after the data
path is done with the pages (paths/base.py: ``DataPath.serve``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from transfer.faults import P_POINTS, injected
from transfer.leases import Lease
from transfer.link import Link
from transfer.mapper import MapperError, Segment, map_pages, source_bytes, total_bytes
from transfer.messages import Message, PullError, PullRequest, TransferAck
from transfer.paths.base import ServeFailed
from transfer.paths.staging import Chunk
from transfer.stats import TransferStats
from transfer.tp_mapper import head_source_bytes, map_heads

if TYPE_CHECKING:
    from transfer.sender import KVSender

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)


class ServeSession:
    def __init__(
        self,
        sender: KVSender,
        link: Link,
        request: PullRequest,
        lease: Lease,
        segments: list[Segment],
        chunks: list[Chunk],
    ) -> None:
        self.sender = sender
        self.config = sender.config
        self.link = link
        self.request = request
        self.lease = lease
        self.segments = segments
        self.chunks = chunks  # the UCX path's (empty for a direct read)
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.failing = False
        self.ack: TransferAck | None = None  # D's final notice, once it came
        point = sender.faults.point(request.request_id)
        self.fault = point if point in P_POINTS else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def deliver(self, msg: Message) -> None:
        self.events.put_nowait(("msg", msg))

    def _on_closed(self, reason: str) -> None:
        self.events.put_nowait(("closed", reason))

    async def send(self, msg: Message) -> None:
        await self.link.send(msg, self.config.done_deadline_s)

    async def next_event(self, timeout: float, what: str) -> tuple[str, Any]:
        """The next event; raises ServeFailed for a timeout or a closed link."""
        try:
            async with asyncio.timeout(timeout):
                kind, value = await self.events.get()
        except TimeoutError:
            raise ServeFailed(f"no progress for {timeout}s waiting for {what}") from None
        if kind == "closed":
            raise ServeFailed(f"link closed: {value}")
        return kind, value

    async def wait_for_notice(self, timeout: float) -> bool:
        """Wait for D's final notice (kept in ``ack``); False when none came within ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                while self.ack is None:
                    kind, value = await self.events.get()
                    if kind == "closed":
                        return False
                    if isinstance(value, TransferAck):
                        self.ack = value
        except TimeoutError:
            return False
        return True

    def inject(self, point: str) -> None:
        if self.fault == point:
            self.sender.book.bump("injected_faults")
            raise ServeFailed(injected(point))

    async def run(self) -> None:
        start, rid = time.perf_counter(), self.request.request_id
        self.link.add_close_listener(self._on_closed)
        error = ""
        try:
            await self.link.path.serve(self)
            if self.ack is None:
                how = "served; no notice from the decode side within its deadline"
            elif self.ack.ok:
                how = "acked"
            else:
                error = how = f"the decode side failed the transfer: {self.ack.error}"
        except (ServeFailed, ConnectionError) as e:
            error = str(e)
            how = f"failed: {error}"
            if self.ack is None and not self.link.closed:  # (D gave up first: it knows)
                err = PullError(rid, self.request.pull_id, "failed", error)
                self.link.post(err, self.config.done_deadline_s)
            log.warning("serving %s failed: %s", rid, error)
        except Exception as e:  # a bug, or a device error: the pages still go back
            log.exception("serving %s failed unexpectedly", rid)
            error = how = f"internal error: {e!r}"
            self.link.abort(f"serving {rid} failed: {e!r}")
        finally:
            self.link.remove_close_listener(self._on_closed)
            try:
                nbytes = 0 if error else self.request.total_bytes
                chunks = len(self.chunks) or 1
                pages = (
                    {} if error else {g: len(ids) for g, ids in self.request.dst_page_ids.items()}
                )
                stats = TransferStats(
                    rid, "send", nbytes, chunks, time.perf_counter() - start, not error, error,
                    self.link.path.name, pages,
                )  # fmt: skip
                # Recorded before the lease ends: its release callback may look for the record
                # (a tensor-parallel worker joins its ranks' records, worker_common/tp_transfer.py).
                self.sender.book.record(stats)
            finally:
                self.sender.leases.end(self.lease, how)


def admit(sender: KVSender, link: Link, req: PullRequest) -> ServeSession | PullError:
    """The session for ``req``, its lease held; or the PullError to refuse it with."""
    rid = req.request_id

    def refuse(code: str, reason: str) -> PullError:
        sender.book.bump("refused_pulls")
        log.info("pull of %s refused: %s", rid, reason)
        return PullError(rid, req.pull_id, code, reason)

    sender.book.bump("expired_leases", sender.leases.expire_due())
    direct = link.path.name != "ucx"
    num_chunks = len(req.chunk_sizes)
    if (direct and num_chunks) or len(set(req.credits)) != len(req.credits):
        return refuse("mismatch", f"a plan of {num_chunks} chunks on the {link.path.name} path")
    if any(not 0 <= i < num_chunks for i in req.credits):
        return refuse("mismatch", f"credits {req.credits[:8]} for {num_chunks} chunks")
    lease = sender.leases.find(rid, req.lease_gen)
    if not isinstance(lease, Lease):
        return refuse(*lease)
    if req.src_page_ids != lease.page_ids:
        return refuse("mismatch", f"the ticket's pages of {rid!r} differ from the published ones")
    if set(req.skip_pages) != set(lease.page_ids) or any(
        not 0 <= req.skip_pages[g] <= len(p) for g, p in lease.page_ids.items()
    ):
        return refuse("mismatch", f"skip_pages {req.skip_pages} do not fit the pages of {rid!r}")
    src = {g: p[req.skip_pages[g] :] for g, p in lease.page_ids.items()}
    segments: list[Segment] = []
    chunks: list[Chunk] = []
    if direct:  # D maps and copies the pages itself: only the bytes it declares are checked
        if lease.heads is None:
            ours = source_bytes(sender.page_table, src)
        else:  # the lease's head slice of each page (D's map_heads checks it holds them)
            ours = head_source_bytes(sender.page_table, src, lease.heads[1])
    else:
        try:
            if lease.heads is not None:
                segments = map_heads(
                    sender.page_table, link.peer_table, src, req.dst_page_ids, *lease.heads
                )
            else:
                segments = map_pages(sender.page_table, link.peer_table, src, req.dst_page_ids)
            chunks = sender.cut(segments, req.chunk_sizes)
        except (MapperError, ValueError) as e:
            return refuse("mismatch", f"cannot map the pages of {rid!r}: {e}")
        ours = total_bytes(segments)
    if ours != req.total_bytes:
        return refuse("mismatch", f"plans differ: ours {ours} bytes, D's {req.total_bytes}")
    if not sender.leases.begin(lease):
        return refuse("busy", f"request {rid!r} is already being pulled, or its lease ended")
    if lease.declared_prompt_len != req.expected_prompt_len:  # the request is lost: pages go
        reason = (
            f"declared history mismatch: P declares {lease.declared_prompt_len} prompt tokens, "
            f"expected {req.expected_prompt_len}"
        )
        sender.leases.end(lease, reason)
        return refuse("mismatch", reason)
    return ServeSession(sender, link, req, lease, segments, chunks)


async def answer_credits(link: Link, req: PullRequest, timeout: float) -> None:
    """Complete the receives D posted for ``req.credits`` with empty messages (nothing is
    written), so a refused pull costs D neither its buffers nor the link. Only credits that name
    a chunk of D's plan, once each: D posts no receive for others (an out-of-range credit is a
    malformed request, refused; one past the tag's range would fail the send and close the link)."""
    credits = sorted({i for i in req.credits if 0 <= i < len(req.chunk_sizes)})
    try:
        async with asyncio.timeout(timeout):
            for i in credits:
                await link.send_data(_EMPTY, link.data_tag(req.pull_id, i))
    except Exception as e:  # ucxx's errors are not all ConnectionErrors
        link.abort(f"answering the credits of a refused pull failed: {e!r}")
