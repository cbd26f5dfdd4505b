"""IovOps (transfer/ucp_iov.py) on the process's real UCX worker: a piece-list message between two
endpoints, cancelled receives, sends UCP never ends, and a runtime stopped with requests out."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

import transfer.ucp_iov
from tests.transfer.test_runtime import in_fresh_process
from transfer.runtime import UcxRuntime
from transfer.ucp_abi import OP_FREED, OP_OUT, completion_callbacks
from transfer.ucp_iov import IovOps, UcpIovError

pytestmark = pytest.mark.timeout(60)


def pieces(buf: np.ndarray, order: list[int], size: int) -> list[tuple[int, int]]:
    return [(buf.ctypes.data + i * size, size) for i in order]


def fresh_tag() -> int:
    return random.getrandbits(63)  # a message nobody else's receive can match


def test_pages_listed_on_both_sides_arrive_in_the_listed_places(ucx_runtime: UcxRuntime) -> None:
    iov = ucx_runtime.iov
    assert iov is not None
    assert iov.called_back == (completion_callbacks() is not None)
    ep = ucx_runtime.run(ucx_runtime.create_endpoint(ucx_runtime.worker_address), timeout=10)
    src = np.random.default_rng(0).integers(0, 255, 16 * 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_order, dst_order = [3, 0, 15, 7], [9, 2, 4, 11]
    tag, pending = fresh_tag(), set()

    async def move() -> None:
        receive = asyncio.ensure_future(iov.recv(pieces(dst, dst_order, 4096), tag, pending))
        await ep.send(src[:4096], tag=fresh_tag(), force_tag=True)  # (any wired endpoint)
        whole = np.ascontiguousarray(src.reshape(16, 4096)[src_order]).reshape(-1)
        await ep.send(whole, tag=tag, force_tag=True)
        await receive

    try:
        ucx_runtime.run(move(), timeout=10)
        assert not pending
        assert np.array_equal(dst.reshape(16, 4096)[dst_order], src.reshape(16, 4096)[src_order])
    finally:
        ep.abort()


def test_one_piece_goes_as_plain_bytes_to_and_from_a_list(ucx_runtime: UcxRuntime) -> None:
    """A one-piece message is posted as contiguous bytes (UCP's default datatype); a list on the
    other side of it still gets the bytes in its pieces' order, either way round."""
    iov = ucx_runtime.iov
    ep = ucx_runtime.run(ucx_runtime.create_endpoint(ucx_runtime.worker_address), timeout=10)
    src = np.random.default_rng(1).integers(0, 255, 4 * 4096, dtype=np.uint8)
    listed, whole = np.zeros_like(src), np.zeros_like(src)
    pending: set[int] = set()
    one_piece = [(src.ctypes.data, src.size)]

    async def move() -> None:
        tag = fresh_tag()
        receive = asyncio.ensure_future(iov.recv(pieces(listed, [2, 0, 3, 1], 4096), tag, pending))
        await iov.send(ep.ucp_endpoint, one_piece, tag, pending)
        await receive
        tag = fresh_tag()
        receive = asyncio.ensure_future(iov.recv([(whole.ctypes.data, whole.size)], tag, pending))
        await iov.send(ep.ucp_endpoint, pieces(listed, [2, 0, 3, 1], 4096), tag, pending)
        await receive

    try:
        ucx_runtime.run(move(), timeout=10)
        assert not pending
        assert np.array_equal(listed.reshape(4, 4096)[[2, 0, 3, 1]].reshape(-1), src)
        assert np.array_equal(whole, src)
    finally:
        ep.abort()


def test_a_cancelled_receive_ends_with_an_error(ucx_runtime: UcxRuntime) -> None:
    iov, buf, pending = ucx_runtime.iov, np.zeros(8192, dtype=np.uint8), set()

    async def cancelled() -> None:
        receive = asyncio.ensure_future(iov.recv(pieces(buf, [1, 0], 4096), fresh_tag(), pending))
        await asyncio.sleep(0.05)
        assert len(pending) == 1 and not receive.done()
        iov.cancel(pending)
        await receive

    with pytest.raises(UcpIovError, match="failed"):
        ucx_runtime.run(cancelled(), timeout=10)
    assert not pending


def test_finished_requests_go_back_to_ucp_in_their_callbacks(
    ucx_runtime: UcxRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the C callbacks, the loop never frees a finished request: from the loop, that free
    waited on the worker's spinlock while the progress thread held it (csrc/ucp_done.c)."""
    iov = ucx_runtime.iov
    if not iov.called_back:
        pytest.skip("no C callbacks here (no compiler, or DUET_UCP_CALLBACKS=0): the loop frees")
    freed = []
    real_lib = iov._lib

    async def settle() -> None:  # (cancelled requests of earlier tests the loop still frees)
        iov._free_now()

    ucx_runtime.run(settle(), timeout=10)

    class CountingLib:
        def __getattr__(self, name):
            fn = getattr(real_lib, name)
            return (lambda *a: freed.append(a) or fn(*a)) if name == "ucp_request_free" else fn

    monkeypatch.setattr(iov, "_lib", CountingLib())
    ep = ucx_runtime.run(ucx_runtime.create_endpoint(ucx_runtime.worker_address), timeout=10)
    src = np.random.default_rng(2).integers(0, 255, 64 * 4096, dtype=np.uint8)  # (rendezvous)
    dst, pending = np.zeros_like(src), set()

    async def move() -> None:
        tag = fresh_tag()
        receive = asyncio.ensure_future(
            iov.recv(pieces(dst, list(range(64))[::-1], 4096), tag, pending)
        )
        await iov.send(ep.ucp_endpoint, pieces(src, list(range(64)), 4096), tag, pending)
        await receive

    try:
        ucx_runtime.run(move(), timeout=10)
        assert not pending and not iov._out and freed == []
        assert np.array_equal(dst.reshape(64, 4096)[::-1].reshape(-1), src)
    finally:
        ep.abort()


def test_a_cancel_after_the_callback_leaves_the_finished_receive_alone(
    ucx_runtime: UcxRuntime,
) -> None:
    """A receive whose callback has run (and given the request back to UCP) before the loop read
    its report: a cancel then must not reach UCP, whose request memory may serve another
    request by now. The receive ends well, with its bytes."""
    iov = ucx_runtime.iov
    if not iov.called_back:
        pytest.skip("no C callbacks here (no compiler, or DUET_UCP_CALLBACKS=0)")
    ep = ucx_runtime.run(ucx_runtime.create_endpoint(ucx_runtime.worker_address), timeout=10)
    src = np.arange(8192, dtype=np.uint8)
    dst, pending, tag = np.zeros_like(src), set(), fresh_tag()
    loop = ucx_runtime.loop

    async def finished_then_cancelled() -> None:
        receive = asyncio.ensure_future(iov.recv(pieces(dst, [1, 0], 4096), tag, pending))
        await asyncio.sleep(0.01)
        (key,) = pending
        op = iov._out[key]
        loop.remove_reader(iov._pipe[0])  # (the report waits in the pipe until we listen again)
        try:
            await ep.send(src, tag=tag, force_tag=True)
            deadline = time.monotonic() + 5
            while iov._callbacks.state(op.slot)[0] == OP_OUT and time.monotonic() < deadline:
                time.sleep(0.001)  # (the loop stays here: nothing reads the report meanwhile)
            assert iov._callbacks.state(op.slot)[0] == OP_FREED and key in iov._out
            iov.cancel(pending)
        finally:
            iov._watching = False
            iov._watch()
        await receive

    try:
        ucx_runtime.run(finished_then_cancelled(), timeout=10)
        assert not pending and not iov._out
        assert np.array_equal(dst.reshape(2, 4096)[[1, 0]].reshape(-1), src)
    finally:
        ep.abort()


def test_a_send_ucp_never_ends_is_abandoned_after_its_cancel(
    ucx_runtime: UcxRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody receives it (UCP cannot cancel a send): its waiter fails GIVE_UP_S after the
    cancel, and its IOV array is kept, never freed, since UCP may still read it."""
    monkeypatch.setattr(transfer.ucp_iov, "GIVE_UP_S", 0.2)
    iov, pending = ucx_runtime.iov, set()
    ep = ucx_runtime.run(ucx_runtime.create_endpoint(ucx_runtime.worker_address), timeout=10)
    buf = np.ones(1 << 20, dtype=np.uint8)  # a rendezvous: it waits for a receive
    kept = len(transfer.ucp_iov._KEPT)

    async def unanswered() -> None:
        send = asyncio.ensure_future(
            iov.send(ep.ucp_endpoint, pieces(buf, [1, 0], 1 << 19), fresh_tag(), pending)
        )
        await asyncio.sleep(0.05)
        iov.cancel(pending)
        await send

    try:
        with pytest.raises(UcpIovError, match="abandoned"):
            ucx_runtime.run(unanswered(), timeout=10)
        assert not pending and len(transfer.ucp_iov._KEPT) == kept + 1
    finally:
        ep.abort()


def test_stopping_the_runtime_with_a_receive_out_keeps_its_pieces_safe() -> None:
    """The runtime's stop cancels the receive and gives it back to UCP (else UCX warns at exit
    that a request was not returned, and the last line would not be "ok")."""
    in_fresh_process(
        """
import asyncio, numpy as np
from transfer.runtime import UcxRuntime
import transfer.ucp_iov as u
rt = UcxRuntime.acquire({"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"})
buf = np.zeros(8192, dtype=np.uint8)
pending = set()
rt.submit(rt.iov.recv([(buf.ctypes.data, 4096), (buf.ctypes.data + 4096, 4096)], 12345, pending))
rt.run(asyncio.sleep(0.05), timeout=5)
assert len(pending) == 1
rt.release()
assert not pending and not u._KEPT
print("ok")
"""
    )


def test_without_a_thread_safe_worker_there_are_no_piece_lists(monkeypatch) -> None:
    class Lib:  # a worker that answers "single-threaded"
        def ucp_worker_query(self, worker, attr):
            attr._obj.thread_mode = 0
            return 0

    monkeypatch.setattr(transfer.ucp_iov, "load_libucp", lambda: Lib())
    with pytest.raises(UcpIovError, match="not thread-safe"):
        IovOps(1)
