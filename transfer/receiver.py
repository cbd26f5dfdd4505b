"""KVReceiver: the decode side of the transceiver.

    receiver = KVReceiver(kv.buffers, specs, model="smollm2", config=cfg)
    result = await receiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)
    if not result.ok: free the pages (result.error says why)

``dst_page_ids[g]`` are D's pages for ``ticket.page_ids[g][skip_pages:]`` (the first ``skip_pages``
pages D already holds from its own prefix hit), one for one. ``pull`` returns only when the transfer
is complete and checked (over UCX, P has been acked; a direct read tells P right after) or has
failed and nothing of it can still write the pages unordered (a direct copy past its deadline has
the model's stream wait for it). It never raises for transfer problems: they are a failed
TransferResult.

One control connection and one UCX endpoint per prefill worker are cached and shared by concurrent
pulls (links.py).

With ``direct_copy``, a link to a prefill worker whose pools open here (the same process, CUDA IPC
or shared host memory on the same host) reads every ticket with a lease board slot directly
(direct_read.py). Once such a link exists, a pull runs entirely on the caller's thread or event
loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer.config import TransceiverConfig
from transfer.copy_wait import LateCopies, outlast_cancels
from transfer.direct_copy import DirectCopier, slot_capacity
from transfer.direct_read import DirectRead
from transfer.ipc import warm_up
from transfer.links import PeerLinks
from transfer.messages import (
    Message,
    PullError,
    Reject,
    TransferDone,
    TransferTicket,
)
from transfer.peer import PeerLink
from transfer.pull import PullSession
from transfer.serve import settle
from transfer.side import TransceiverSide
from transfer.stats import TransferResult

log = logging.getLogger(__name__)


class KVReceiver(TransceiverSide):
    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        specs: Sequence[PoolGroupSpec],
        model: str,
        config: TransceiverConfig,
    ) -> None:
        """See TransceiverSide (transfer/side.py) for the arguments."""
        super().__init__(buffers, specs, model, config)
        self.sessions: dict[int, PullSession] = {}
        self.links = PeerLinks(self, self._on_message)
        # Pulls on the loop, with their result futures (loop only).
        self._tasks: dict[asyncio.Task, tuple[PullSession, concurrent.futures.Future]] = {}
        self.closed = False
        self._reads_lock = threading.Lock()
        self._reads_in_flight = 0
        # Launches the copies of direct reads on our GPU (None on the CPU, where they are plain
        # copies).
        self.direct_copier: DirectCopier | None = None
        self.late_copies = LateCopies()  # direct copies that outlived their pull (GPU only)
        try:
            if config.direct_copy and self.rows_on_gpu:
                with torch.cuda.device(self.device):
                    warm_up(self.rows)  # compile the copy kernel now, not in the first pull
                    self.direct_copier = DirectCopier(self.device, slot_capacity(self.rows))
            self.runtime.run(self._start(), timeout=config.connect_deadline_s)
        except BaseException:
            self.runtime.release()
            raise

    async def _start(self) -> None:
        self.staging = self._make_staging()

    # ---- API (any thread / any event loop) ----
    async def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        """Pull the request's KV into ``dst_page_ids`` (see module docstring). Awaitable from any
        event loop; a direct read runs on it, any other pull on the transceiver's loop thread."""
        read = self._fast_read(ticket, dst_page_ids, skip_pages, expected_prompt_len)
        if read is not None:
            with self.counting_read():
                return await read.run()
        session, done = self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len)
        try:
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            # The session fails the pull (ending its receives) before we hand the pages back.
            try:
                self.runtime.call_soon(session.cancel)
            except RuntimeError:  # the transceiver's loop is closed: nothing of the pull runs
                raise asyncio.CancelledError from None
            if not await outlast_cancels(asyncio.wrap_future(session.quiet), self._quiet_within_s):
                log.error(
                    "cancelled pull of %s did not end within %.0fs; its pages may still be written",
                    ticket.request_id,
                    self._quiet_within_s,
                )
            raise

    @property
    def _quiet_within_s(self) -> float:
        """The longest a pull takes to end after a cancel: a connect, or its failure's steps."""
        cfg = self.config
        waits = max(cfg.connect_deadline_s, cfg.pull_deadline_s) + cfg.done_deadline_s
        return waits + 7 * cfg.chunk_deadline_s + 5.0  # (_clean_up: a feeder, an answer, receives)

    def pull_blocking(
        self,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> TransferResult:
        """``pull`` for plain threads. Every step inside has its own deadline."""
        read = self._fast_read(ticket, dst_page_ids, skip_pages, expected_prompt_len)
        if read is not None:
            with self.counting_read():
                return read.run_blocking()
        return self._submit(ticket, dst_page_ids, skip_pages, expected_prompt_len)[1].result()

    def fence_late_copy(self, event: torch.cuda.Event) -> None:
        """A copy into our pages is still running although its pull ended (past its deadline, or
        cancelled), and the caller gets the pages back now: the model's stream (and every page copy
        of ours, which orders itself after that stream) waits for it, and so does the next pull that
        lets UCX write into pool memory (LateCopies)."""
        torch.cuda.default_stream(self.device).wait_event(event)
        self.late_copies.add(event)
        self.book.bump("late_copies")

    def direct_read(
        self,
        link: PeerLink,
        ticket: TransferTicket,
        dst: Mapping[str, Sequence[int]],
        skip: int,
        expected: int,
    ) -> DirectRead | None:
        """A direct read of ``ticket`` over ``link``, or None when it must go over UCX (no direct
        access to that peer, or the lease is not on its board)."""
        access = link.access
        if access is None or link.closed or ticket.lease_slot < 0:
            return None
        return DirectRead(self, link, access, ticket, dst, skip, expected)

    def _fast_read(
        self, ticket: TransferTicket, dst: Mapping[str, Sequence[int]], skip: int, expected: int
    ) -> DirectRead | None:
        """A direct read over an existing link, run without the transceiver's loop."""
        if self.closed:
            raise RuntimeError("KVReceiver is closed")
        link = self.links.open.get((ticket.host, ticket.port))
        if link is None or link.info.instance_id != ticket.instance_id:
            return None  # first contact, or a restarted peer: the loop (re)connects
        # The ids stay as the caller gave them: the copy takes them as they are, and the checks
        # convert them while it runs.
        return self.direct_read(link, ticket, dst, int(skip), int(expected))

    def counting_read(self) -> _ReadCount:
        """A direct read on a caller's thread: counted, so ``close`` can wait for it."""
        return _ReadCount(self)

    def stats(self) -> dict[str, Any]:
        return {
            **self.book.snapshot(),
            "peers": len(self.links.open),
            "pulls_in_flight": len(self.sessions) + self._reads_in_flight,
        }

    def close(self) -> None:
        """Fail pulls in flight (their pages are safe once this returns) and drop every link.
        Once: later calls do nothing."""
        if not self._begin_close():
            return
        self.closed = True  # no new pulls, direct or not
        try:
            self.runtime.run(self._stop(), timeout=self.config.chunk_deadline_s * 3 + 5.0)
            deadline = time.monotonic() + self.config.chunk_deadline_s * 2
            while self._reads_in_flight and time.monotonic() < deadline:
                time.sleep(0.005)  # direct reads run on their callers' threads: let them end
        finally:
            self.runtime.release()

    # ---- loop side ----
    def _submit(
        self, ticket: TransferTicket, dst: Mapping[str, Sequence[int]], skip: int, expected: int
    ) -> tuple[PullSession, Any]:
        """The pull's session and the future of its result, run on the loop thread."""
        if self.closed:
            raise RuntimeError("KVReceiver is closed")
        dst_pages = {g: [int(p) for p in ids] for g, ids in dst.items()}
        pull_id = random.getrandbits(63)
        session = PullSession(self, ticket, dst_pages, int(skip), int(expected), pull_id)
        # Our own task and result future (not ``runtime.submit``'s): ``close`` may cancel the
        # task, and the future must still end only once the pull has, with a result.
        done: concurrent.futures.Future[TransferResult] = concurrent.futures.Future()

        def start() -> None:
            if self.closed:  # ``close`` ran in between: the pull never starts
                done.set_result(session.ended_by_close())
                return
            task = asyncio.ensure_future(session.run())
            self._tasks[task] = session, done
            session.on_result = lambda result: done.done() or done.set_result(result)
            task.add_done_callback(self._finished)

        self.runtime.call_soon(start)
        return session, done

    def _finished(self, task: asyncio.Task) -> None:
        session, done = self._tasks.pop(task)
        if done.done():  # (``_stop`` gave up on it)
            return
        if task.cancelled():  # by ``_stop``, after the pull's clean-up
            done.set_result(session.ended_by_close())
        elif task.exception() is not None:
            done.set_exception(task.exception())
        else:
            done.set_result(task.result())

    async def _stop(self) -> None:
        """End every pull: aborting the links fails those that use one. A pull still connecting
        (a peer that accepts but never answers, say) would run to its connect deadline, and one
        stuck past its deadlines for whatever reason would outlive the loop this returns to, and
        its caller would wait forever: both are cancelled, which ends them with a failed result
        once their receives have ended."""
        self.closed = True
        self.links.abort_all("receiver closing")
        tasks = dict(self._tasks)
        for task, (session, _) in tasks.items():
            if session.connecting:
                task.cancel()
        if await settle(list(tasks), self.config.chunk_deadline_s * 2):
            return
        for task in tasks:
            task.cancel()
        if await settle(list(tasks), self.config.chunk_deadline_s):
            return
        for task, (session, done) in tasks.items():  # the loop stops next: answer the callers
            if not task.done() and not done.done():
                log.error("pull of %s did not end at close", session.ticket.request_id)
                done.set_result(session.ended_by_close())

    def _on_message(self, link: PeerLink, msg: Message) -> None:
        if isinstance(msg, PullError | TransferDone):
            session = self.sessions.get(msg.pull_id)
            if session is None or session.link is not link:
                log.info(
                    "late %s for pull %d of %s dropped",
                    type(msg).__name__,
                    msg.pull_id,
                    msg.request_id,
                )
            else:
                session.deliver(msg)
        elif isinstance(msg, Reject):
            hit = [
                s
                for s in self.sessions.values()
                if s.link is link and s.ticket.request_id == msg.request_id
            ]
            for session in hit:
                session.deliver(msg)
            if not hit:
                log.warning("%s: %s", link.name, msg.reason)
        else:
            log.warning("%s: unexpected %s dropped", link.name, type(msg).__name__)


class _ReadCount:
    """KVReceiver.counting_read: a plain context manager (a generator-based one costs a few
    microseconds more on every pull)."""

    __slots__ = ("r",)

    def __init__(self, receiver: KVReceiver) -> None:
        self.r = receiver

    def __enter__(self) -> None:
        with self.r._reads_lock:
            self.r._reads_in_flight += 1

    def __exit__(self, *_exc: object) -> None:
        with self.r._reads_lock:
            self.r._reads_in_flight -= 1
