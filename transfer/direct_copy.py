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

A slot is held by its pull until the pull ends (``release``) and, after that, until the copy that
read it has completed (its event): ids are never rewritten under a running kernel, even when a pull
gives up on its copy, and a pull never waits on an event re-recorded for someone else's copy. A pull
that finds no free slot big enough uploads its ids to the GPU instead (slower, same copy).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from transfer.ipc import FIRST_ROW
from transfer.plan import DirectPlan
from transfer.staging import side_stream, word_rows

if TYPE_CHECKING:
    from kernels.page_copy_triton import PreparedCopy

SLOTS = 8  # concurrent direct reads with pinned ids; more fall back to uploads


class _Slot:
    def __init__(self, capacity: int) -> None:
        self.ids = torch.empty((2, capacity), dtype=torch.int64, pin_memory=True)
        self.host = self.ids.numpy()  # the same memory, written without torch's dispatch
        # Where the source and destination ids start (the kernel reads them from here).
        self.src_at, self.dst_at = self.ids[0].data_ptr(), self.ids[1].data_ptr()
        self.event = torch.cuda.Event()
        self.held = False  # by a pull that has not ended yet
        self.used = False  # the event was recorded at least once


class QueuedCopy:
    """A direct read's copy once queued: ``event`` completes with it; ``release`` when the pull
    ends (the copy itself may still run)."""

    def __init__(self, event: torch.cuda.Event, slot: _Slot | None = None) -> None:
        self.event = event
        self._slot = slot

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
        self._slots = [_Slot(self.capacity) for _ in range(slots)]
        self._lock = threading.Lock()
        self._next = 0

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
                # A launch failed after others were queued: D's model stream (and the slot's
                # next use) are ordered after them.
                failed = slot.event if slot is not None else torch.cuda.Event()
                failed.record(self.stream)
                self._model.wait_event(failed)
                if slot is not None:
                    slot.used, slot.held = True, False
                raise

    def _take(self, need: int) -> _Slot | None:
        if need > self.capacity:
            return None
        with self._lock:
            for k in range(len(self._slots)):
                slot = self._slots[(self._next + k) % len(self._slots)]
                if not slot.held and (not slot.used or slot.event.query()):
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
        slot.used = True

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
            word_rows(src_rows[src_pool]), word_rows(dst_rows[dst_pool]), first_row=FIRST_ROW
        )
    return copy


MAX_SLOT_IDS = 1 << 16  # 65536 pages: far beyond one request; larger pulls upload their ids


def slot_capacity(rows: Mapping[str, torch.Tensor]) -> int:
    """Ids one pull can need at most: every page of every destination pool, plus one per pool
    (each pool's ids start at an even offset), capped at MAX_SLOT_IDS so that pools of millions of
    small pages do not pin tens of megabytes of host memory."""
    return min(MAX_SLOT_IDS, int(np.sum([r.shape[0] + 1 for r in rows.values()])))
