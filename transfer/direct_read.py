"""DirectRead: the decode side of one pull on a direct link, where D reads P's pages itself.

    one copy kernel from P's pages into ours, on our GPU -> while it runs, every check: the
    ticket's pages mapped onto ours (compatibility, pools, counts, ids in range, no page twice),
    and P's lease board (the lease is live, names exactly the ticket's request and pages, and P
    declares the expected prompt length) -> the copy ends -> the board again: the same lease is
    still live -> a record on our done board, which P polls (P releases its pages).

The checks run while the copy runs, to keep them off the latency path; that is as safe as checking
first. The copy kernel skips any page id outside either pool or naming the null page, so unchecked
ids cannot touch memory beyond the pools, and a failed check fails the pull once the copy has
ended: the copy only wrote pages of ours that the failed pull gives back. Generations are never
reused, and P publishes a lease only once its pages are final, so a lease found live at the first
look was live since before the ticket existed, and seeing it live again after the copy proves it was
live all through the copy. On the CPU (P in this process, or its pools in shared memory), and for
pages whose pools or counts do not line up, everything is checked first.

On GPUs the copy is queued by one C call (DirectCopier.start_pages, kernels/native_launch.py)
straight from the page ids as the caller has them; the checks then read the ids back from the
pinned slot the kernel reads, with the bounds and repeats the C call found while queueing. Without
a C compiler the same copy is queued from Python (DirectCopier.start), only slower.

Nothing waits for P: the whole pull runs on the caller's thread (``run_blocking``) or event loop
(``run``), with no hop to the transceiver's loop, so it costs the copy plus tens of microseconds.
P learns of it from a record on our done board for that link (done_board.py; ReadDone when P did
not open it); if that is lost, the lease expires as usual. A failure once the lease was found live
(a declared-history mismatch, a forged ticket, a cancelled pull) sends ReadDone with the reason,
so both sides get their pages back at once. A pull returns only when its copy has ended,
or, past the deadline, with D's model stream ordered after it. KV is never trimmed or padded: any
mismatch fails the pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from transfer.copy_wait import outlast_cancels, wait_copy, wait_copy_blocking
from transfer.direct_copy import QueuedCopy
from transfer.host_copy import copy_on_cpu
from transfer.lease_board import lease_digest
from transfer.mapper import MapperError
from transfer.messages import ReadDone, TransferTicket
from transfer.peer import DirectAccess, PeerLink
from transfer.plan import DirectPlan, checked_direct_plan, direct_plan, unchecked_direct_pairs
from transfer.pull_checks import PullFailed, check_declared, source_pages
from transfer.stats import TransferResult, TransferStats

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class DirectRead:
    def __init__(
        self,
        receiver: KVReceiver,
        link: PeerLink,
        access: DirectAccess,
        ticket: TransferTicket,
        dst_page_ids: Mapping[str, Sequence[int]],
        skip_pages: int,
        expected_prompt_len: int,
    ) -> None:
        self.r = receiver
        self.link = link
        self.access = access  # held here: the link drops its own reference when it closes
        self.ticket = ticket
        self.dst = dst_page_ids
        self.skip = skip_pages
        self.expected = expected_prompt_len
        self.plan: DirectPlan | None = None
        self._pages: dict[str, np.ndarray] = {}  # the ticket's page ids
        self._word = 0  # the lease's board word, once found live
        self._copy: QueuedCopy | None = None  # on GPUs, once queued
        self._nbytes = 0  # what the copy moves, when the quick checks passed (no plan made)
        self._launched = False  # a GPU copy was (maybe partly) queued
        self._began = time.perf_counter()

    async def run(self) -> TransferResult:
        """The read, waiting for the copy without blocking the caller's event loop."""
        host_copy: asyncio.Future | None = None
        try:
            if self.r.rows_on_gpu:
                problem = self._start()
            else:  # checked here; the copy takes the core: off the loop, on the copy thread
                problem = self._start(copy=False)
                if problem is None:
                    assert self.plan is not None
                    host_copy = asyncio.get_running_loop().run_in_executor(
                        self.r.runtime.copy_executor, self._launch, self.plan
                    )
                    await asyncio.shield(host_copy)
            copied = await wait_copy(self._copy, self.r.config.chunk_deadline_s)
            return self._finish(copied, problem)
        except PullFailed as e:
            return self._fail(str(e))
        except asyncio.CancelledError:  # the caller gave up: P gets its pages back now
            if host_copy is not None:
                # Not before the copy into our pages has ended: the caller frees them next.
                await outlast_cancels(host_copy)
            self._fail("the pull was cancelled")
            raise
        except Exception as e:  # a bug or a device error: still fence the copy and tell P
            return self._internal_error(e)

    def run_blocking(self) -> TransferResult:
        """The read on a plain thread (it waits for the copy on this thread)."""
        try:
            problem = self._start()
            copied = wait_copy_blocking(self._copy, self.r.config.chunk_deadline_s)
            return self._finish(copied, problem)
        except PullFailed as e:
            return self._fail(str(e))
        except Exception as e:  # a bug or a device error: still fence the copy and tell P
            return self._internal_error(e)

    def _start(self, copy: bool = True) -> str | None:
        """Copy (queued on GPUs, done on the CPU unless ``copy`` is False) and check, in the order
        the module docstring gives; returns why the read cannot be accepted, or None. Raises
        PullFailed only when the copy could not be queued (P is told all the same)."""
        if self.r.rows_on_gpu and self._launch_native():
            return self._native_checks()  # while the copy runs
        # Arrays once: the copy, the checks and the digest all want them.
        self._pages = self._ticket_arrays()
        pairs = None
        if self.r.rows_on_gpu:
            pairs = unchecked_direct_pairs(
                self.link.info.page_table, self.r.page_table, self._pages, self.dst, self.skip
            )
        if pairs is None:  # the CPU, or pages that do not line up: check first
            problem = self._checks()
            if problem is None and copy:
                assert self.plan is not None
                self._launch(self.plan)
            return problem
        try:
            self._launch(DirectPlan(pairs, 0))
        except PullFailed:
            self._lease_problem()  # a live lease is then released by ReadDone(ok=False)
            raise
        return self._checks()  # while the copy runs

    def _launch_native(self) -> bool:
        """The copy queued by the C launcher straight from the ids as given (DirectCopier.
        start_pages); False when that path cannot serve this read."""
        copier = self.r.direct_copier
        assert copier is not None, "GPU direct reads go through the DirectCopier"
        self._launched = True  # (a launch that raises may have queued its first part)
        try:
            self._copy = copier.start_pages(
                self.access,
                self.link.info.page_table,
                self.r.page_table,
                self.ticket.page_ids,
                self.dst,
                self.skip,
                self.r.rows,
            )
        except RuntimeError as e:  # D's stream is ordered after anything queued
            self._pages = self._ticket_arrays()  # for the digest
            self._lease_problem()  # a live lease is then released by ReadDone(ok=False)
            raise PullFailed(f"the page copy failed: {e}") from None
        self._launched = self._copy is not None  # None: nothing queued, the caller copies
        return self._launched

    def _native_checks(self) -> str | None:
        """``_checks`` of a read the C launcher queued, answered from its route and slot
        (transfer/native_route.py); skipped pages, or ids not plainly valid, take ``_checks``,
        which says what is wrong."""
        t, copy = self.ticket, self._copy
        assert copy is not None
        plain = None
        # (source_pages' checks: the launch matched each pool's count already)
        if self.skip == 0 and t.compat_hash == copy.route.compat_hash:
            if self.dst.keys() == copy.route.names:
                plain = copy.plain(t.request_id)
        if plain is None:
            return self._checks()
        self._nbytes, digest = plain
        return self._lease_problem(digest)

    def _checks(self) -> str | None:
        """Every check of the read (the mapping, then the lease); the board is read even when the
        mapping fails, so that P, told by ReadDone, gets its pages back at once."""
        try:
            self._map()
            problem = None
        except PullFailed as e:
            problem = str(e)
        lease = self._lease_problem()
        return problem or lease

    def _map(self) -> None:
        """The plan of the read, checked against both page tables (ids in range, pools matched,
        no page twice); raises PullFailed. After the C launcher, the ids checked are the ones the
        copy read, from its slot."""
        read = self._copy.ids() if self._copy is not None and self._copy.native else None
        if not self._pages:
            # The digest's ids: the ticket's, which the slot holds whole when nothing is skipped.
            whole = read is not None and self.skip == 0
            self._pages = (
                {sp: p.src for (sp, _), p in read.items()} if whole else self._ticket_arrays()
            )
        src = source_pages(self.ticket, self.r.page_table, self.dst, self.skip, self._pages)
        try:
            if read is not None:
                self.plan = checked_direct_plan(self.link.info.page_table, self.r.page_table, read)
            else:
                self.plan = direct_plan(self.link.info.page_table, self.r.page_table, src, self.dst)
        except (MapperError, ValueError) as e:
            raise PullFailed(f"cannot map the pages: {e}") from None

    def _ticket_arrays(self) -> dict[str, np.ndarray]:
        """The ticket's page ids as int64 arrays (the checks and the digest want them so). Ids
        that are not page ids fail the read; if the ticket names a live lease all the same, P is
        told (ReadDone), as for a ticket whose pages differ from the lease's, and frees its pages
        now rather than when the lease expires."""
        try:
            return {g: np.asarray(ids, dtype=np.int64) for g, ids in self.ticket.page_ids.items()}
        except (OverflowError, TypeError, ValueError) as e:
            live = _live_word(self.ticket)
            if self.access.board.word(self.ticket.lease_slot) == live:
                self._word = live
            raise PullFailed(f"the ticket's page ids are not page ids: {e}") from None

    def _lease_problem(self, ours: bytes | None = None) -> str | None:
        """Why P's board does not vouch for this read, or None (and the lease's word is kept).
        ``ours``: the lease digest of the ticket, when the caller has it already."""
        t = self.ticket
        word, declared, digest = self.access.board.entry(t.lease_slot)
        if word != _live_word(t):
            return (
                f"the lease of request {t.request_id!r} ended (expired, or released) before the "
                "read: the prefill worker no longer holds its pages"
            )
        self._word = word
        if digest != (lease_digest(t.request_id, self._pages) if ours is None else ours):
            return (
                f"the ticket's pages of {t.request_id!r} differ from the ones the prefill worker "
                "leased"
            )
        try:
            check_declared(declared, self.expected)
        except PullFailed as e:
            return str(e)
        return None

    def _launch(self, plan: DirectPlan) -> None:
        copier = self.r.direct_copier
        try:
            if copier is None:  # CPU pools: the copy is done when this returns
                assert not self.r.rows_on_gpu, "GPU direct reads go through the DirectCopier"
                copy_on_cpu(plan, self.access.rows, self.r.rows)
            else:
                self._launched = True
                self._copy = copier.start(plan, self.access.copies, self.access.rows, self.r.rows)
        except (RuntimeError, ValueError) as e:  # D's stream is ordered after anything queued
            raise PullFailed(f"the page copy failed: {e}") from None

    def _fence_unfinished_copy(self) -> None:
        """A pull that ends before its copy did (deadline, cancel, a launch that failed midway)
        hands back pages the copy may still write: everything that may write them next waits for
        the copy (fence_late_copy), through an event of its own recorded now on the copy stream
        (a slot's event is recorded again by the slot's next copy)."""
        copier = self.r.direct_copier
        if copier is None or not self._launched:
            return  # host copies are done when they return; nothing was queued
        if self._copy is not None and self._copy.query():
            return
        event = torch.cuda.Event()
        event.record(copier.stream)
        if not event.query():
            log.error(
                "the page copy of %s is still running after its pull ended; the model's stream "
                "waits for it",
                self.ticket.request_id,
            )
            self.r.fence_late_copy(event)

    def _finish(self, copied: bool, problem: str | None) -> TransferResult:
        if not copied:
            raise PullFailed(
                f"the page copy did not end within {self.r.config.chunk_deadline_s}s "
                "(chunk_deadline_s)"
            )
        if problem is not None:
            raise PullFailed(problem)
        if self.access.board.word(self.ticket.lease_slot) != self._word:
            raise PullFailed(
                f"the lease of request {self.ticket.request_id!r} ended during the read (expired, "
                "or released): the pages read may have been reused"
            )
        return self._end(True, "")

    def _internal_error(self, e: Exception) -> TransferResult:
        log.exception("direct read of %s failed unexpectedly", self.ticket.request_id)
        return self._fail(f"internal error: {type(e).__name__}: {e}")

    def _fail(self, reason: str) -> TransferResult:
        log.warning("direct read of %s failed: %s", self.ticket.request_id, reason)
        try:
            self._fence_unfinished_copy()
        except Exception:  # a broken device, say: still give the slot back and tell P
            log.exception("fencing the copy of %s failed", self.ticket.request_id)
        return self._end(False, reason)

    def _post_done(self, ok: bool, error: str, nbytes: int, elapsed: float) -> None:
        t = self.ticket
        done = ReadDone(
            t.request_id, t.lease_gen, ok, error, nbytes, int(elapsed * 1e6), self.access.data_path
        )
        self.link.post(done)

    def _end(self, ok: bool, error: str) -> TransferResult:
        elapsed = time.perf_counter() - self._began
        mapped = self.plan is not None or self._nbytes > 0
        nbytes = (self.plan.total_bytes if self.plan is not None else self._nbytes) if ok else 0
        chunks = 1 if mapped else 0
        if self._copy is not None:
            self._copy.release()
            # The plan and the digest's ids may be views of the slot, which the next pull reuses.
            self.plan, self._pages = None, {}
        if self._word:  # the lease was live when we looked: tell P it may release it now
            t, done = self.ticket, self.access.done
            if ok and done is not None:  # a few stores: nothing wakes our loop (done_board.py)
                done.post(
                    t.lease_slot, t.lease_gen, nbytes, int(elapsed * 1e6), self.access.data_path
                )
            else:
                try:  # (built on the loop thread: the caller's is on the latency path)
                    self.r.runtime.call_soon(self._post_done, ok, error, nbytes, elapsed)
                except RuntimeError as e:  # the transceiver is closing: the lease expires instead
                    log.info("ReadDone for %s not sent: %s", t.request_id, e)
        stats = TransferStats(
            self.ticket.request_id,
            "recv",
            nbytes,
            chunks,
            elapsed,
            ok,
            error,
            self.access.data_path,
        )
        self.r.book.record(stats, chunks=1 if ok else 0)
        return TransferResult(self.ticket.request_id, ok, error, stats)


def _live_word(ticket: TransferTicket) -> int:
    """The board word of the ticket's lease while it is live (lease_board.py)."""
    return (ticket.lease_gen << 1) | 1
