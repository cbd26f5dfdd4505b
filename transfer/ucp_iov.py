"""Tag messages whose bytes are a list of (address, length) pieces: UCP's IOV datatype.

ucxx sends and receives one contiguous buffer. Scattered KV pages then cost a gather copy into a
staging buffer on P and a scatter copy on D; on a CPU host those copies compete with TCP's own for
the same cores. UCP takes a list of pieces as one message (``ucp_dt_make_iov``) and packs and
unpacks them in the copies it makes anyway, so here they go straight from pages to pages. ucxx
exposes the UCP handles of its worker and endpoints for this; the calls (transfer/ucp_abi.py) go
to the same ``libucp`` that ucxx loaded, on the same worker, which ucxx creates thread-safe
(``UCS_THREAD_MODE_MULTI``, checked at start). A one-piece message goes as plain bytes (UCP's
contiguous datatype), so runs of host pages come here too: their completions reach the loop sooner
than ucxx's (11-28% of a 1-4 MiB pull, 0-12% at 16-256 MiB: docs/benchmarks/transfer.md,
eighteenth and nineteenth passes).

Completions: UCP calls a C function of ours on ucxx's progress thread (csrc/ucp_done.c) that stores
the status in the request's op slot, gives the request back to UCP there (under the worker's lock
it already holds: from the loop, that free spun on the lock for a millisecond at a time), and
writes the slot's address into a non-blocking pipe the loop watches; the loop then hands those
statuses to their waiters (it looks at every slot if the pipe was ever full). (A Python callback
there would take the GIL inside the worker's lock: a deadlock with any Python thread holding the
GIL while it waits for that lock.) Without a C compiler the loop polls UCP instead, every
``POLL_S`` while requests are out, and frees the requests itself, ``FREE_LATER_S`` after it handed
their statuses over. ucxx's progress thread may sleep in epoll when a request is posted from the
loop thread; ``ucp_worker_signal`` wakes it. A cancelled wait cancels the UCP
request, which stays ours (and its pieces UCP's) until UCP says it is done.

Sends go only on an endpoint that has completed a contiguous rendezvous send (the primer of
primer.py, or a chunk): UCX 1.21 never completes an IOV send that is an endpoint's first rendezvous
(PeerLink.piece_sends_ok). Receives have no such limit. Host memory only: on GPUs one staged
message over NVLink already runs at the copy engines' rate.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from transfer.mapper import SMALL_RUNS
from transfer.plan import Chunk
from transfer.ucp_abi import (
    FULL_TAG_MASK,
    OP_ENDED,
    OP_FREED,
    UCP_DATATYPE_IOV,
    UCP_OP_ATTR_FIELD_CALLBACK,
    UCP_OP_ATTR_FIELD_DATATYPE,
    UCP_OP_ATTR_FIELD_USER_DATA,
    UCP_WORKER_ATTR_FIELD_THREAD_MODE,
    UCS_ERR_LAST,
    UCS_INPROGRESS,
    UCS_OK,
    UCS_THREAD_MODE_MULTI,
    OpSlot,
    UcpIovError,
    UcpRequestParam,
    UcpWorkerAttr,
    completion_callbacks,
    iov_array,
    load_libucp,
)

POLL_S = 100e-6  # without callbacks: how late a completion can be seen
# How long after a request's status went to its waiter the loop frees it (when it frees): right
# after the report the progress thread often still holds the worker's lock, and the free spins on
# it (docs/benchmarks/transfer.md, nineteenth pass).
FREE_LATER_S = 0.005
GIVE_UP_S = 30.0  # a cancelled request still out this much later is abandoned (see ``cancel``)


Pieces = np.ndarray  # uint64 [n, 2]: (address, length) per piece, in message order


def chunk_pieces(chunk: Chunk, rows: Mapping[str, torch.Tensor], source: bool) -> Pieces:
    """(address, bytes) of ``chunk``'s pages on one side, in wire order, neighbours merged. In
    numpy: both sides list a scattered 256 MiB chunk's 1024 pages before its first byte moves."""
    if len(chunk.fragments) <= SMALL_RUNS:  # (numpy's per-call cost outweighs a short loop)
        out: list[list[int]] = []
        bases = {name: r.data_ptr() for name, r in rows.items()}
        for f in chunk.fragments:
            address = (
                bases[f.src_pool] + f.src_offset if source else bases[f.dst_pool] + f.dst_offset
            )
            if out and out[-1][0] + out[-1][1] == address:
                out[-1][1] += f.nbytes
            else:
                out.append([address, f.nbytes])
        return np.array(out, dtype=np.uint64).reshape(-1, 2)
    src_pools, dst_pools, src_offsets, dst_offsets, nbytes = zip(*chunk.fragments)
    pools, offsets = (src_pools, src_offsets) if source else (dst_pools, dst_offsets)
    address = np.array(offsets, dtype=np.uint64)
    if len(set(pools)) == 1:
        address += np.uint64(rows[pools[0]].data_ptr())
    else:
        bases = {name: r.data_ptr() for name, r in rows.items()}
        address += np.array([bases[p] for p in pools], dtype=np.uint64)
    size = np.array(nbytes, dtype=np.uint64)
    first = np.empty(len(size), dtype=bool)  # a piece that does not continue the one before
    first[0] = True
    np.not_equal(address[1:], address[:-1] + size[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return np.stack((address[starts], np.add.reduceat(size, starts)), axis=1)


class _Op(NamedTuple):
    """A request out: its waiter, the IOV array UCP reads until done, the caller's pending set,
    the request, and (with callbacks) the op slot its callback writes."""

    fut: asyncio.Future
    arr: ctypes.Array
    pending: set[int]
    req: int
    slot: OpSlot | None


class IovOps:
    """Tag sends and receives of piece lists on one UcxRuntime's worker, awaited on its loop.

    Each call takes a ``pending`` set (a link's): the request's key is in it while UCP works on it,
    so that ``cancel`` can end a link's receives when the link fails (a receive is the worker's,
    not the endpoint's: closing the endpoint would not end it). A request's key is its op slot's
    address with callbacks (the callback frees the request: csrc/ucp_done.c), else the request."""

    def __init__(self, worker_handle: int) -> None:
        self._lib = load_libucp()
        self._worker = worker_handle
        attr = UcpWorkerAttr(field_mask=UCP_WORKER_ATTR_FIELD_THREAD_MODE)
        self._check(self._lib.ucp_worker_query(self._worker, ctypes.byref(attr)), "worker query")
        if attr.thread_mode != UCS_THREAD_MODE_MULTI:
            raise UcpIovError(f"UCX worker is not thread-safe (thread mode {attr.thread_mode})")
        self._out: dict[int, _Op] = {}
        self._to_free: list[int] = []  # finished requests the loop frees soon (``_free_later``)
        self._given_up: dict[int, float] = {}  # cancelled request's key -> when to stop asking
        self._poller: asyncio.Task | None = None
        self._watching = False
        self._callbacks = completion_callbacks()
        self.called_back = self._callbacks is not None
        # send and receive of a piece list, then of one piece as contiguous bytes (UCP's default
        # datatype: a run of pages needs no list for UCP to walk).
        params = [UcpRequestParam() for _ in range(4)]
        for p in params[:2]:
            p.op_attr_mask, p.datatype = UCP_OP_ATTR_FIELD_DATATYPE, UCP_DATATYPE_IOV
        self._pipe: tuple[int, int] | None = None
        if self._callbacks is not None:
            self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # (read end, write end)
            callbacks = (self._callbacks.send, self._callbacks.recv) * 2
            for p, cb in zip(params, callbacks):
                p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA
                p.cb = cb  # (user_data: each request's own op slot, set as it is posted)
        self._params = tuple(params)

    def _status_text(self, status: int) -> str:
        return f"{self._lib.ucs_status_string(status).decode()} ({status})"

    def _check(self, status: int, what: str, pieces: Pieces | None = None) -> None:
        if status != UCS_OK:
            if pieces is not None:  # (described only on failure: a sum over every piece)
                sizes = np.asarray(pieces, dtype=np.uint64).reshape(-1, 2)[:, 1]
                what = f"IOV {what} of {int(sizes.sum())} bytes in {len(sizes)} pieces"
            raise UcpIovError(f"UCP {what} failed: {self._status_text(status)}")

    async def send(self, ep_handle: int, pieces: Pieces, tag: int, pending: set[int]) -> None:
        """Send ``pieces`` as one tagged message on UCP endpoint ``ep_handle`` (which must stay
        open until this returns: closing it ends the send with an error)."""
        arr, buffer, count, params, slot = self._operands(pieces, 0)
        req = self._lib.ucp_tag_send_nbx(ep_handle, buffer, count, tag, params)
        await self._complete(req, arr, slot, pieces, "send", pending)

    async def recv(self, pieces: Pieces, tag: int, pending: set[int]) -> None:
        """Receive the message tagged ``tag`` into ``pieces`` (a shorter message fills a prefix)."""
        arr, buffer, count, params, slot = self._operands(pieces, 1)
        req = self._lib.ucp_tag_recv_nbx(self._worker, buffer, count, tag, FULL_TAG_MASK, params)
        await self._complete(req, arr, slot, pieces, "receive", pending)

    def _operands(
        self, pieces: Pieces, side: int
    ) -> tuple[ctypes.Array, Any, int, UcpRequestParam, OpSlot | None]:
        """(the IOV array UCP reads until done, buffer, count, parameters, op slot) of a message
        of ``pieces`` (``side`` 0 sends, 1 receives): one piece as that many contiguous bytes.
        UCP copies the parameters' user data into the request as it is posted, so one parameter
        block serves every request of its kind."""
        arr = iov_array(pieces)
        if len(arr) == 1:
            buffer, count, params = arr[0].buffer, arr[0].length, self._params[2 + side]
        else:
            buffer, count, params = arr, len(arr), self._params[side]
        slot = None
        if self._pipe is not None:
            slot = OpSlot(fd=self._pipe[1])
            params.user_data = ctypes.addressof(slot)
        return arr, buffer, count, params, slot

    def cancel(self, pending: set[int]) -> None:
        """Ask UCP to end every request in ``pending``. UCP ends a receive it has not matched yet;
        one it did, and a send, end with their endpoint's close. One still out ``GIVE_UP_S``
        later fails its waiter (its peer is gone: nothing will write its pieces any more) and is
        kept, never freed, with its IOV array."""
        for key in list(pending):
            self._cancel(key)
        self._give_up_later(list(pending))

    def _cancel(self, key: int) -> None:
        op = self._out.get(key)
        if op is None:
            return
        if op.slot is None:
            self._lib.ucp_request_cancel(self._worker, op.req)
        else:  # (not if its callback has freed it: see csrc/ucp_done.c)
            assert self._callbacks is not None
            self._callbacks.cancel(self._worker, op.slot)

    def close(self) -> None:
        """On the loop, before the worker stops: cancel what is out, give UCP back what that
        ended, and stop watching. Requests UCP still holds keep their IOV arrays and op slots
        (never freed), and the pipe stays open, since UCP may still call back into it."""
        for key in list(self._out):
            self._cancel(key)
            self._given_up[key] = 0.0  # (``_finish`` abandons what is still out)
        self._finish(list(self._out))
        self._free_now()
        if self._watching and self._pipe is not None:
            asyncio.get_running_loop().remove_reader(self._pipe[0])
            self._watching = False
        if self._poller is not None:
            self._poller.cancel()

    async def _complete(
        self,
        req: int | None,
        arr: ctypes.Array,
        slot: OpSlot | None,
        pieces: Pieces,
        what: str,
        pending: set[int],
    ) -> None:
        if req is None:  # done at once (NULL is UCS_OK; no callback comes)
            return
        if req >= (1 << 64) + UCS_ERR_LAST:  # an error status in place of a request
            self._check(req - (1 << 64), what, pieces)
        # ucxx's progress thread may sleep in epoll: wake it to progress what we posted.
        self._lib.ucp_worker_signal(self._worker)
        fut = asyncio.get_running_loop().create_future()
        key = req if slot is None else ctypes.addressof(slot)
        if slot is not None:
            slot.request = req
        self._out[key] = _Op(fut, arr, pending, req, slot)
        pending.add(key)
        self._watch()
        if slot is None:
            self._finish([key])  # (it may be done already)
        # (with callbacks, one that ran already has written its report: the loop reads it next)
        try:
            status = await fut
        except asyncio.CancelledError:  # UCP still owns the pieces: kept until UCP is done
            self._cancel(key)
            self._give_up_later([key])
            raise
        self._check(status, what, pieces)

    def _give_up_later(self, keys: list[int]) -> None:
        """On the loop: look at ``keys`` again GIVE_UP_S from now (nothing may report a request
        UCP never ends), and abandon those still out then."""
        deadline = time.monotonic() + GIVE_UP_S
        for key in keys:
            self._given_up.setdefault(key, deadline)
        asyncio.get_running_loop().call_later(GIVE_UP_S + 0.1, self._finish, keys)

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pipe is not None:
            if not self._watching:
                loop.add_reader(self._pipe[0], self._on_reported)
                self._watching = True
        elif self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll())

    def _on_reported(self) -> None:
        """The callbacks wrote finished requests' op slots: hand those over (look at every slot
        when the pipe was full)."""
        assert self._pipe is not None and self._callbacks is not None
        reported: list[int] = []
        while True:
            try:
                data = os.read(self._pipe[0], 8 * 1024)
            except BlockingIOError:
                break
            reported += [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
            if len(data) < 8 * 1024:
                break
        if self._callbacks.overflowed.value:
            self._callbacks.overflowed.value = 0  # (before the sweep: a later overflow is seen)
            reported = list(self._out)
        self._finish(reported)

    async def _poll(self) -> None:
        while self._out:
            await asyncio.sleep(POLL_S)
            self._finish(list(self._out))

    def _ended(self, op: _Op) -> int | None:
        """UCP's status of ``op`` if UCP is done with it (the request then given back), else
        None."""
        lib = self._lib
        if op.slot is None:
            status = lib.ucp_request_check_status(op.req)
            if status == UCS_INPROGRESS:
                return None
            self._free_later(op.req)
            return status
        assert self._callbacks is not None
        state, status = self._callbacks.state(op.slot)
        if state == OP_ENDED:  # its callback ran while we cancelled it: ours to free
            self._free_later(op.req)
        elif state != OP_FREED:
            return None
        return status

    def _free_later(self, req: int) -> None:
        """Give ``req`` back to UCP ``FREE_LATER_S`` from now (the requests no callback freed:
        polled ones, and cancelled ones whose callback left them to us; ``close`` frees what is
        left at once)."""
        if not self._to_free:
            asyncio.get_running_loop().call_later(FREE_LATER_S, self._free_now)
        self._to_free.append(req)

    def _free_now(self) -> None:
        reqs, self._to_free = self._to_free, []
        for req in reqs:
            self._lib.ucp_request_free(req)

    def _finish(self, keys: list[int]) -> None:
        """Hand each of ``keys`` that UCP has finished to its waiter; fail the waiters of
        cancelled ones that UCP did not end in time."""
        now = time.monotonic()
        for key in keys:
            op = self._out.get(key)
            if op is None:  # a stale report: finished and handed over already
                continue
            status = self._ended(op)
            if status is None:
                if now < self._given_up.get(key, float("inf")):
                    continue
                _KEPT.append(self._out.pop(key))  # UCP may still use it: never freed
                status_text = "UCP did not end it within GIVE_UP_S of its cancel"
                if not op.fut.done():
                    op.fut.set_exception(UcpIovError(f"request abandoned: {status_text}"))
            else:
                del self._out[key]
                if not op.fut.done():
                    op.fut.set_result(status)
            self._given_up.pop(key, None)
            op.pending.discard(key)


# Requests UCP may still use after their owner gave up, with their IOV arrays and op slots: kept
# for the process.
_KEPT: list[_Op] = []
