"""The UCX path: a pull's pages as chunks, one UCX tag message each (paths/staging.py).

    D: post receives into free staging buffers -> PullRequest (the plan, and those chunks as
       credits) -> as each chunk lands: scatter it, post the next receive, credit it (ChunkReady)
       -> TransferDone: every chunk arrived with its bytes, the declared history matches
    P: for each credited chunk: gather it into a staging buffer, send it -> TransferDone once
       every send is posted with its bytes -> D's final notice (or the ack deadline) -> the pages
       may go

A chunk whose pages are one stretch of a host pool skips the staging on that side: D receives it
into its pages themselves (no buffer, no scatter, credited at once), P sends it from its pages
(no gather, not queued behind other sends). D plans such chunks for large host pages
(staging.plan_runs); each side decides for itself from the pages it holds.

Flow control: P sends only chunks D credited, so every send of P completes and no staging buffer
waits on another, whatever the number of concurrent pulls on either side.

One rule ends every pull cleanly: P answers each chunk D credited with exactly one message, with
its bytes, or empty once the pull has failed on either side (D's negative notice, P's own
refusal or failure), and D waits for each receive it posted before its pull returns. Only a
broken or stalled link breaks the rule: then the link is aborted, which ends the requests on it
(ucxx cancels them; one UCX cannot end within another chunk deadline is counted, and if it may
still write D's pages, the pull waits for it and the receiver's ``on_wedged`` hears of it).
(UCX does not say how long a received message was, so an empty answer that lands before P's
refusal is scattered like data: a failed pull may leave anything in its own pages, which its
caller frees. A pull succeeds only after TransferDone, which P sends only when every chunk went
with its bytes.)
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from transfer.mapper import total_bytes
from transfer.messages import ChunkReady, PullRequest, Reject, TransferAck, TransferDone
from transfer.paths.base import DataPath, PullFailed, ServeFailed
from transfer.paths.staging import Chunk, gather, in_place, scatter

if TYPE_CHECKING:
    from transfer.pull import PullSession
    from transfer.serve import ServeSession

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)


class UcxPath(DataPath):
    name = "ucx"

    # ---- D ----
    async def fetch(self, pull: PullSession) -> int:
        r, cfg, link, t = pull.r, pull.config, pull.link, pull.ticket
        assert link is not None
        chunks = r.cut(pull.map(), link.peer_table)
        pull.chunks = len(chunks)
        pending = collections.deque(chunks)
        receives: list[asyncio.Task] = []
        writing: set[asyncio.Task] = set()  # receives that may write our pages now (_receive)

        def post(buf: torch.Tensor | None = None) -> list[int]:
            """Post receives for pending chunks, in order: straight into our pool where the
            chunk's pages are one stretch of it, else into ``buf``, then while buffers are free."""
            posted = []
            while pending and not pull.failing:
                target = in_place(pending[0], r.rows, source=False)
                if target is None:
                    buf = buf if buf is not None else r.staging.try_acquire()
                    if buf is None:
                        break
                chunk = pending.popleft()
                into = (target, None) if target is not None else (buf, buf)
                receives.append(asyncio.ensure_future(self._receive(pull, chunk, *into, writing)))
                posted.append(chunk.index)
                if target is None:
                    buf = None
            if buf is not None:  # (the pull failed while we waited for it)
                r.staging.release(buf)
            return posted

        async def feed() -> None:
            """Credit the other chunks as buffers free up (one ChunkReady per batch)."""
            while pending and not pull.failing:
                posted = post(await r.staging.acquire())
                if posted:
                    try:
                        await pull.send(ChunkReady(t.request_id, pull.pull_id, posted))
                    except ConnectionError:  # the link's close listener fails the pull
                        return

        nbytes = total_bytes(pull.segments)
        request = PullRequest(
            t.request_id,
            pull.pull_id,
            t.lease_gen,
            t.page_ids,
            pull.dst,
            pull.skip,
            pull.expected,
            [c.nbytes for c in chunks],
            nbytes,
            post(),
        )
        feeder: asyncio.Task | None = None
        try:
            await pull.send(request)
            if pending:  # (more chunks than free buffers: credit the rest as buffers free up)
                feeder = asyncio.ensure_future(feed())
            arrived, done = 0, None
            if not chunks:  # (D holds every page: the pull fails where the data would be)
                pull.inject("mid_data")
            while arrived < len(chunks) or done is None:
                if arrived == 0:
                    timeout, what = cfg.pull_deadline_s, "the first chunk or P's answer"
                elif arrived < len(chunks):
                    timeout, what = cfg.chunk_deadline_s, f"chunk {arrived + 1}/{len(chunks)}"
                else:
                    timeout, what = cfg.done_deadline_s, "TransferDone after the last chunk"
                kind, value = await pull.next_event(timeout, what)
                if kind == "chunk":
                    arrived += 1
                    if 2 * arrived >= len(chunks):
                        pull.inject("mid_data")
                elif kind == "recv_failed":
                    raise PullFailed(f"receiving a chunk failed: {value}")
                elif isinstance(value, TransferDone):
                    done = value
                else:
                    raise PullFailed(f"unexpected {type(value).__name__} during the transfer")
            if (done.num_chunks, done.total_bytes) != (len(chunks), nbytes):
                raise PullFailed(
                    f"incomplete transfer: P sent {done.num_chunks} chunks / {done.total_bytes} "
                    f"bytes, we expected {len(chunks)} / {nbytes}"
                )
            pull.check_declared(done.declared_prompt_len)
            r.book.bump("chunks", len(chunks))
            return nbytes
        except PullFailed as e:
            pull.failing = True
            pull.notify(False, str(e))  # before waiting: P answers the chunks still credited
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            await _end_receives(pull, receives, writing)

    async def _receive(
        self,
        pull: PullSession,
        chunk: Chunk,
        into: torch.Tensor,
        staged: torch.Tensor | None,
        writing: set[asyncio.Task],
    ) -> None:
        """Receive a chunk ``into`` our pool's pages themselves, or into the ``staged`` buffer
        and scatter it from there. In ``writing`` while it may write our pages: the receive in
        place, a staged chunk's scatter."""
        r, me = pull.r, asyncio.current_task()
        assert me is not None
        try:
            assert pull.link is not None
            if staged is None:
                writing.add(me)
            await pull.link.recv_data(
                into[: chunk.nbytes], pull.link.data_tag(pull.pull_id, chunk.index)
            )
            # (A failed pull's late chunks may be empty: never scattered.)
            if staged is not None and not pull.failing:
                writing.add(me)
                await r.runtime.copy(staged.device, scatter, chunk, staged, r.rows)
            pull.events.put_nowait(("chunk", chunk.index))
        except Exception as e:  # ucxx's errors (a closed endpoint) are not all ConnectionErrors
            pull.events.put_nowait(("recv_failed", f"{type(e).__name__}: {e}"))
        finally:
            writing.discard(me)
            if staged is not None:
                r.staging.release(staged)

    # ---- P ----
    async def serve(self, pull: ServeSession) -> None:
        cfg, req, chunks = pull.config, pull.request, pull.chunks
        sends: dict[int, asyncio.Task] = {}
        # Host memory: one send at a time, in credit order, the next chunk's gather under it, so
        # D's scatter of a chunk runs under the next one's bytes (sends all at once share the
        # wire and land together). Between GPUs, concurrent messages overlap their latencies.
        gate = asyncio.Semaphore(len(chunks) if pull.sender.staging.device.type == "cuda" else 1)

        done = TransferDone(
            req.request_id,
            req.pull_id,
            pull.lease.declared_prompt_len,
            req.total_bytes,
            len(chunks),
        )
        started = 0

        def start() -> None:
            """A chunk's send begins with its bytes. Once every chunk's has, D may finish: it
            hears so while the last bytes travel (not after them, one more wait on D)."""
            nonlocal started
            started += 1
            if started == len(chunks):
                pull.link.post(done, cfg.done_deadline_s)

        def grant(credits: list[int]) -> None:
            for i in credits:
                if not 0 <= i < len(chunks) or i in sends:
                    raise ServeFailed(f"invalid credit for chunk {i} of {len(chunks)}")
                sends[i] = asyncio.ensure_future(self._send(pull, chunks[i], gate, start))

        try:
            grant(req.credits)
            pull.inject("before_data")
            if not chunks:  # (nothing to move: D already holds every page)
                await pull.send(done)
            sent = 0
            while sent < len(chunks):
                kind, value = await pull.next_event(
                    cfg.chunk_deadline_s, f"credits or chunk sends ({sent}/{len(chunks)} sent)"
                )
                if kind == "sent":
                    sent += 1
                elif kind == "send_failed":
                    pull.link.abort(f"sending a chunk of {req.request_id} failed: {value}")
                    raise ServeFailed(f"sending a chunk failed: {value}")
                elif isinstance(value, ChunkReady):
                    grant(value.chunks)
                elif isinstance(value, TransferAck):
                    pull.ack = value  # (an ok one may come before our sends' completions)
                    if not value.ok:
                        raise ServeFailed(f"the decode side gave up: {value.error}")
                elif isinstance(value, Reject):
                    raise ServeFailed(value.reason)
            pull.sender.book.bump("chunks", len(chunks))
            if pull.ack is None:
                await pull.wait_for_notice(cfg.ack_deadline_s)
        except (ServeFailed, ConnectionError):
            pull.failing = True  # the sends not begun yet go empty
            await _end_sends(pull, sends)
            raise

    async def _send(
        self, pull: ServeSession, chunk: Chunk, gate: asyncio.Semaphore, start: Callable[[], None]
    ) -> None:
        s, tag = pull.sender, pull.link.data_tag(pull.request.pull_id, chunk.index)
        try:
            source = None if pull.failing else in_place(chunk, s.rows, source=True)
            if pull.failing:
                await pull.link.send_data(_EMPTY, tag)
            elif source is not None:  # straight from our pool, at once (paths/staging.py)
                start()
                await pull.link.send_data(source, tag)
            else:
                buf = await s.staging.acquire()
                try:
                    if not pull.failing:  # (it may have failed while we waited for the buffer)
                        await s.runtime.copy(buf.device, gather, chunk, s.rows, buf[: chunk.nbytes])
                    async with gate:
                        if pull.failing:
                            await pull.link.send_data(_EMPTY, tag)
                        else:
                            start()
                            await pull.link.send_data(buf[: chunk.nbytes], tag)
                finally:
                    s.staging.release(buf)
            pull.events.put_nowait(("sent", chunk.index))
        except Exception as e:  # ucxx's errors are not all ConnectionErrors
            pull.events.put_nowait(("send_failed", f"{type(e).__name__}: {e}"))


async def _end_receives(
    pull: PullSession, receives: list[asyncio.Task], writing: set[asyncio.Task]
) -> None:
    """Wait for every posted receive: P answers each credited chunk, so on a live link they end
    within a chunk deadline; otherwise abort the link, which ends them within another. Those that
    outlive even that: a staged one only holds its buffer (the pull is failing: it scatters
    nothing), so the pull ends without it; one that may write our pages (``writing``) keeps the
    pull from returning, and the receiver's ``on_wedged`` hears of it, once."""
    if not receives:
        return
    limit = pull.config.chunk_deadline_s
    _, waiting = await asyncio.wait(receives, timeout=limit)
    if not waiting:
        return
    pull.failing = True  # from here no staged chunk is scattered
    assert pull.link is not None
    pull.link.abort(f"receives of pull {pull.pull_id} did not end within {limit}s")
    _, waiting = await asyncio.wait(waiting, timeout=limit)
    if not waiting:
        return
    pull.r.book.bump("wedged_messages", len(waiting))
    problem = f"{len(waiting)} UCX receives of pull {pull.pull_id} outlived the abort of their link"
    if not waiting & writing:
        log.error("%s; their staging buffers stay taken until they end", problem)
        return
    if pull.r.on_wedged is not None:
        pull.r.on_wedged(f"{problem}, some into its pages")  # (a worker's process ends here)
    log.error("%s, some into its pages: the pull keeps them until they end", problem)
    while waiting & writing:
        _, waiting = await asyncio.wait(waiting & writing, timeout=limit)


async def _end_sends(pull: ServeSession, sends: dict[int, asyncio.Task]) -> None:
    """Wait for every send of the pull (those not begun go empty); a send that does not end
    within a chunk deadline means a stalled link: abort it, which ends them within another (or
    the pull ends without them: a send never writes our pages)."""
    if not sends:
        return
    limit = pull.config.chunk_deadline_s
    _, waiting = await asyncio.wait(sends.values(), timeout=limit)
    if not waiting:
        return
    pull.link.abort(f"sends of pull {pull.request.pull_id} did not end within {limit}s")
    _, waiting = await asyncio.wait(waiting, timeout=limit)
    if waiting:  # a send only reads: its pages may go; its staging buffer stays until it ends
        pull.sender.book.bump("wedged_messages", len(waiting))
        log.error(
            "%d UCX sends of pull %d outlived the abort of their link; the pull ends without "
            "them (their staging buffers stay taken until they end)",
            len(waiting),
            pull.request.pull_id,
        )
