"""DirectCopier: how D queues the copy of a direct read on its GPU (direct_read.py decides what to
copy and checks the lease; ipc.py opens P's pools).

A pull's host time is on the latency path of every request, and on an H200 the copy of 16 MiB
takes ~50 us, so the launch has to cost far less than the generic path (a pageable id upload,
stream context managers and Triton's dispatch: ~60 us, docs/benchmarks/transfer.md). Here:
- the page ids go into a pinned host slot, which the kernel reads itself (no upload);
- the copy is queued on the transceiver's "direct" stream behind one reused event recorded on D's
  model stream (the destination pages may have been freed by a request whose reads are still
  queued there);
- each pool pair's launch is prepared once (kernels.page_copy_triton.PreparedCopy) and called
  with the stream explicitly.

With the C launcher (kernels/native_launch.py, ``start_pages``) all of that is one C call that
holds the GIL: the ids are copied into the slot straight from the caller's lists or arrays, the
model-stream mark is recorded and waited on, the kernels are launched with cuLaunchKernel (a long
read in two parts, the first launched before the rest's ids are converted) and the slot's event is
recorded; only then does it scan the ids (bounds, repeats) for the checks, which
run while the copy does. ``start`` is the same copy launched from Python, for machines without a
C compiler and for pools the C launcher cannot serve.

A slot is held by its pull until the pull ends (``release``) and, after that, until the copy that
read it has completed (its event): ids are never rewritten under a running kernel, even when a pull
gives up on its copy, and a pull never waits on an event re-recorded for someone else's copy. A pull
that finds no free slot big enough uploads its ids to the GPU instead (slower, same copy).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels import native_launch
from transfer.ipc import FIRST_ROW
from transfer.mapper import MapperError, match_pools
from transfer.native_route import NativeRoute
from transfer.page_table import PageTable
from transfer.plan import DirectPlan, IdPair
from transfer.staging import as_words, side_stream

if TYPE_CHECKING:
    from kernels.page_copy_triton import PreparedCopy
    from transfer.peer import DirectAccess

log = logging.getLogger(__name__)

SLOTS = 8  # concurrent direct reads with pinned ids; more fall back to uploads


class _Slot:
    def __init__(self, capacity: int, stream: torch.cuda.Stream, native: Any) -> None:
        self.ids = torch.empty((2, capacity), dtype=torch.int64, pin_memory=True)
        self.host = self.ids.numpy()  # the same memory, written without torch's dispatch
        # Where the source and destination ids start (the kernel reads them from here).
        self.src_at, self.dst_at = self.ids[0].data_ptr(), self.ids[1].data_ptr()
        self.event = torch.cuda.Event()
        # Recorded once now: torch makes the CUDA event on its first record, and the C launcher
        # records it by handle.
        self.event.record(stream)
        self.handle = self.event.cuda_event
        # Whether the event completed: cuEventQuery straight from C when we can (torch's query
        # lets go of the GIL, and another thread may then keep a spinning pull waiting).
        self._query = (
            functools.partial(native.query, self.handle) if native is not None else self.event.query
        )
        self.held = False  # by a pull that has not ended yet
        # A copy was recorded on the event and not yet seen complete: a pull that waited for its
        # copy leaves the slot free of any driver call for the next one.
        self.busy = False

    def query(self) -> bool:
        if self._query():
            self.busy = False
            return True
        return False


class QueuedCopy:
    """A direct read's copy once queued: ``query()`` (or ``event``) completes with it; ``release``
    when the pull ends (the copy itself may still run). From the C launcher (``stats`` given),
    ``ids()`` gives the page ids the copy read, as views of its slot, with what the launcher found
    out about them."""

    def __init__(
        self,
        event: torch.cuda.Event,
        slot: _Slot | None = None,
        route: NativeRoute | None = None,
        stats: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.event = event
        self._slot = slot
        self.route = route
        self._stats = stats
        self.query = slot.query if slot is not None else event.query
        self.native = route is not None  # queued by the C launcher

    def ids(self) -> dict[tuple[str, str], IdPair]:
        """The ids per (source pool, destination pool), read from the slot: only until
        ``release``."""
        assert self._slot is not None and self.route is not None
        out, at, host = {}, 0, self._slot.host
        for (sp, dp, _), stats in zip(self.route.pairs, self._stats):
            n = stats[0]
            out[(sp, dp)] = IdPair(host[0, at : at + n], host[1, at : at + n], *stats[1:])
            at += n + n % 2
        return out

    def plain(self, request_id: str) -> tuple[int, bytes] | None:
        """For a launch that skipped no page: (bytes moved, lease digest of ``request_id`` and
        the ids read) when the launcher found every id plainly valid (NativeRoute), else None
        (the general checks then say what is wrong). Only until ``release``."""
        assert self._slot is not None and self.route is not None
        nbytes = self.route.plain_bytes(self._stats)
        if nbytes is None:
            return None
        return nbytes, self.route.digest(request_id, self._slot.host[0], self._stats)

    def release(self) -> None:
        if self._slot is not None:
            self._slot.held = False
            self._slot = None


class DirectCopier:
    """One per decode side on a GPU; thread-safe (pulls run on their callers' threads)."""

    def __init__(self, device: torch.device, capacity: int, slots: int = SLOTS) -> None:
        self.device = device
        # Pairs of ids start at even offsets, so every id slice stays 16-byte aligned.
        self.capacity = capacity + capacity % 2
        self.stream = side_stream(device, "direct")
        self._handle = self.stream.cuda_stream
        # The fallback's id uploads, on a stream of their own: a pageable upload returns once the
        # ids are staged, and on the copy stream it would wait behind the model's step first.
        self._ids_stream = side_stream(device, "direct-ids")
        self._model = torch.cuda.default_stream(device)
        self._model_mark = torch.cuda.Event()
        # Recorded once here: torch makes an event's CUDA handle on its first record, which two
        # pulls' first records must not race on.
        self._model_mark.record(self._model)
        self._native = native_launch.module()
        self._context = 0
        if self._native is not None:
            try:
                self._context = self._native.primary_context(device.index)
            except RuntimeError:  # a driver the C launcher cannot use: the Python path
                log.exception("the C launcher cannot reach the CUDA driver")
                self._native = None
        self._slots = [_Slot(self.capacity, self.stream, self._native) for _ in range(slots)]
        self._lock = threading.Lock()
        self._next = 0
        self._zero_ids: torch.Tensor | None = None  # for the first, compiling launch of a route

    def start_pages(
        self,
        access: DirectAccess,
        src_table: PageTable,
        dst_table: PageTable,
        src_ids: Mapping[str, Sequence[int]],
        dst_ids: Mapping[str, Sequence[int]],
        skip: int,
        dst_rows: Mapping[str, torch.Tensor],
    ) -> QueuedCopy | None:
        """The whole launch of a direct read in one C call, from the page ids as the caller has
        them (lists or arrays): page ``skip + i`` of each of P's pools ``src_ids`` into page ``i``
        of its matched pool of ours in ``dst_ids``, ids unchecked (the kernel skips ids outside
        the pools and the null page). None when this path cannot serve the read (no C launcher,
        pools or counts that do not line up, ids that are not ints, no free slot): the caller
        then takes ``start``. Raises RuntimeError if a launch fails (as ``start``), or if an id
        of a pool's second launched part is not an int (its first part is queued by then)."""
        if self._native is None:
            return None
        route = access.route
        if route is None:
            route = access.route = self._route(access, src_table, dst_table, dst_rows)
        if route is False or src_ids.keys() != route.names:
            return None
        items = []
        for sp, dp, handle in route.pairs:
            d = dst_ids.get(dp)
            if d is None:
                return None
            items.append((handle, src_ids[sp], d, skip))
        slot = self._take(0)
        if slot is None:
            return None
        try:
            counts = self._native.queue(
                self._context,
                self._handle,
                self._model.cuda_stream,
                self._model_mark.cuda_event,
                slot.handle,
                slot.src_at,
                slot.dst_at,
                self.capacity,
                tuple(items),
            )
        except (TypeError, OverflowError, ValueError):  # ids that are not ints: nothing queued
            slot.held = False
            return None
        except BaseException:
            self._failed(slot)
            raise
        if counts is None:
            slot.held = False
            return None
        slot.busy = True
        return QueuedCopy(slot.event, slot, route, counts)

    def _route(
        self,
        access: DirectAccess,
        src_table: PageTable,
        dst_table: PageTable,
        dst_rows: Mapping[str, torch.Tensor],
    ) -> NativeRoute | bool:
        """The C launcher's route for one peer, made on its first read (False: not servable)."""
        try:
            matched = match_pools(src_table, dst_table)
        except MapperError:
            return False
        pairs = []
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                if self._zero_ids is None:
                    # Two 16-byte aligned ids (the compiled kernel assumes it), zeroed on the copy
                    # stream: the launch below must not read them before they are zero.
                    self._zero_ids = torch.zeros(4, dtype=torch.int64, device=self.device)
                for sp, dp in matched.items():
                    copy = _prepared(access.copies, sp, dp, access.rows, dst_rows)
                    if not copy.ready:  # compile (or find) the kernel: ids 0 name the null page
                        copy.launch(self._zero_ids[0:1], self._zero_ids[2:3], 1, self.stream)
                    handle = copy.native()
                    if handle is None:  # no C launcher for it (kernels.native_launch logged why)
                        return False
                    pairs.append((sp, dp, handle))
        except Exception:  # the Python path serves this peer (and reports any error per pull)
            log.exception("no C launch for the direct reads of this peer")
            return False
        return NativeRoute(tuple(pairs), src_table, dst_table)

    def start(
        self,
        plan: DirectPlan,
        copies: dict[tuple[str, str], PreparedCopy],
        src_rows: Mapping[str, torch.Tensor],
        dst_rows: Mapping[str, torch.Tensor],
    ) -> QueuedCopy:
        """Queue every page copy of ``plan``. ``copies`` caches the prepared launches per (source
        pool, destination pool) of one peer (DirectAccess.copies: P's rows differ per peer).
        Raises RuntimeError/ValueError if a launch fails; D's model stream then waits for
        whatever of the plan was queued."""
        need = sum(len(s) + len(s) % 2 for _, _, s, _ in plan.pairs)
        slot = self._take(need)
        same_device = torch.cuda.current_device() == self.device.index
        with contextlib.nullcontext() if same_device else torch.cuda.device(self.device):
            try:
                if slot is None:
                    return QueuedCopy(self._queue_uploaded(plan, copies, src_rows, dst_rows))
                self._queue(slot, plan, copies, src_rows, dst_rows)
                return QueuedCopy(slot.event, slot)
            except BaseException:
                self._failed(slot)
                raise

    def _failed(self, slot: _Slot | None) -> None:
        """A launch failed after others were queued: D's model stream (and the slot's next use)
        are ordered after them."""
        failed = slot.event if slot is not None else torch.cuda.Event()
        failed.record(self.stream)
        self._model.wait_event(failed)
        if slot is not None:
            slot.busy, slot.held = True, False

    def _take(self, need: int) -> _Slot | None:
        if need > self.capacity:
            return None
        with self._lock:
            for k in range(len(self._slots)):
                slot = self._slots[(self._next + k) % len(self._slots)]
                if not slot.held and (not slot.busy or slot.query()):
                    slot.held = True
                    self._next = (self._next + k + 1) % len(self._slots)
                    return slot
        return None

    def _queue(
        self,
        slot: _Slot,
        plan: DirectPlan,
        copies: dict[tuple[str, str], PreparedCopy],
        src_rows: Mapping[str, torch.Tensor],
        dst_rows: Mapping[str, torch.Tensor],
    ) -> None:
        self._after_model()
        at = 0
        for sp, dp, s, d in plan.pairs:
            n = len(s)
            slot.host[0, at : at + n] = s
            slot.host[1, at : at + n] = d
            copy = _prepared(copies, sp, dp, src_rows, dst_rows)
            if copy.ready:
                copy.launch_ptrs(slot.src_at + 8 * at, slot.dst_at + 8 * at, n, self._handle)
            else:  # the first launch of this pool pair compiles (or finds) the kernel
                copy.launch(slot.ids[0, at : at + n], slot.ids[1, at : at + n], n, self.stream)
            at += n + n % 2
        slot.event.record(self.stream)
        slot.busy = True

    def _queue_uploaded(
        self,
        plan: DirectPlan,
        copies: dict[tuple[str, str], PreparedCopy],
        src_rows: Mapping[str, torch.Tensor],
        dst_rows: Mapping[str, torch.Tensor],
    ) -> torch.cuda.Event:
        """The same copy with the ids uploaded to the GPU (no slot free, or too many ids)."""
        with torch.cuda.stream(self._ids_stream):
            uploads = [
                torch.from_numpy(np.stack([s, d])).to(self.device) for _, _, s, d in plan.pairs
            ]
        self.stream.wait_stream(self._ids_stream)
        self._after_model()
        for (sp, dp, s, _), ids in zip(plan.pairs, uploads):
            ids.record_stream(self.stream)  # not reused for another upload before the copy ran
            _prepared(copies, sp, dp, src_rows, dst_rows).launch(
                ids[0], ids[1], len(s), self.stream
            )
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _after_model(self) -> None:
        """Order the copy stream after D's model stream: the destination pages may have been
        freed by a request whose reads are still queued there. A concurrent pull may record the
        mark again before this wait: it then waits for a later point of the model stream, which
        orders it after everything this pull needs as well."""
        self._model_mark.record(self._model)
        self.stream.wait_event(self._model_mark)


def _prepared(
    copies: dict[tuple[str, str], PreparedCopy],
    src_pool: str,
    dst_pool: str,
    src_rows: Mapping[str, torch.Tensor],
    dst_rows: Mapping[str, torch.Tensor],
) -> PreparedCopy:
    """The prepared launch from ``src_pool`` to ``dst_pool``, made on first use."""
    copy = copies.get((src_pool, dst_pool))
    if copy is None:
        from kernels.page_copy_triton import PreparedCopy  # GPU only: triton is imported here

        copy = copies[(src_pool, dst_pool)] = PreparedCopy(
            *as_words(src_rows[src_pool], dst_rows[dst_pool]), first_row=FIRST_ROW
        )
    return copy


MAX_SLOT_IDS = 1 << 16  # 65536 pages: far beyond one request; larger pulls upload their ids


def slot_capacity(rows: Mapping[str, torch.Tensor]) -> int:
    """Ids one pull can need at most: every page of every destination pool, plus one per pool
    (each pool's ids start at an even offset), capped at MAX_SLOT_IDS so that pools of millions of
    small pages do not pin tens of megabytes of host memory."""
    return min(MAX_SLOT_IDS, int(np.sum([r.shape[0] + 1 for r in rows.values()])))
