"""PeerLinks and the receiver's close against a prefill worker that accepts connections and never
answers (hung, or stopped under a debugger): every pull still ends, each within one
``connect_deadline_s`` of its start however many wait for that worker, and ``close`` ends the
pulls that are still connecting, with a failed result, instead of leaving their callers waiting
on a loop that stopped. A close that gives up waiting for a failing pull still lets its clean-up
end before the caller gets its pages back."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver
from transfer.messages import TransferTicket

pytestmark = pytest.mark.timeout(90)


class SilentPeer:
    """A TCP listener on 127.0.0.1 that accepts and never says a word."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        deadline = time.monotonic() + 80
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                self.accepted.append(self.server.accept()[0])
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.server.close()


@pytest.fixture
def silent() -> Iterator[SilentPeer]:
    peer = SilentPeer()
    yield peer
    peer.close()


def ticket_to(port: int, rid: str, receiver: KVReceiver) -> TransferTicket:
    return TransferTicket(
        rid, "127.0.0.1", port, "a-hung-worker", {"full": [1, 2]}, 8,
        receiver.page_table.compat_hash, time.time() + 60,
    )  # fmt: skip


def test_pulls_waiting_for_one_hung_worker_share_one_connect_deadline(silent) -> None:
    n, limit = 6, 1.0
    d = KVSide(specs(), seed=2)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config(connect_deadline_s=limit))
    try:
        dsts = [d.allocate(f"r{i}", 8) for i in range(n)]

        def pull(i: int) -> tuple[float, object]:
            start = time.monotonic()
            result = receiver.pull_blocking(
                ticket_to(silent.port, f"r{i}", receiver), dsts[i], 0, 8
            )
            return time.monotonic() - start, result

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            ended = list(pool.map(pull, range(n)))
        for took, result in ended:
            assert not result.ok and "timed out" in result.error
            # The deadline each pull was promised: before, the k-th waited for k connects.
            assert took < 3 * limit
        for i in range(n):
            d.free(f"r{i}")
    finally:
        receiver.close()
    d.assert_clean()


def test_close_ends_a_pull_still_connecting_with_a_failed_result(silent) -> None:
    d = KVSide(specs(), seed=2)
    # A connect deadline far past close's own waits: before, close stopped the loop under the
    # connecting pull, whose caller then waited forever.
    receiver = KVReceiver(
        d.kv.buffers, d.specs, MODEL, config(connect_deadline_s=60.0, chunk_deadline_s=1.0)
    )
    dst = d.allocate("r", 8)
    results: list[object] = []
    puller = threading.Thread(
        target=lambda: results.append(
            receiver.pull_blocking(ticket_to(silent.port, "r", receiver), dst, 0, 8)
        )
    )
    puller.start()
    deadline = time.monotonic() + 20
    while not silent.accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert silent.accepted, "the pull never connected"
    receiver.close()
    puller.join(30)
    assert not puller.is_alive(), "the pull's caller was left waiting after close"
    (result,) = results
    assert not result.ok and "receiver closed" in result.error
    d.free("r")
    d.assert_clean()


def test_close_cutting_a_failing_pull_short_still_waits_for_its_page_copy(monkeypatch) -> None:
    # A pull fails (its chunk's page copy is held past the deadline) and, cleaning up, waits for
    # that copy into the caller's pages. Close gives up waiting for it (its first settle "times
    # out" at once here) and cancels it. The cancel used to cut the clean-up short: the caller got
    # its pages back while the copy was still to write them.
    import transfer.pull
    import transfer.receiver
    from tests.transfer.test_transfer_local import Pair
    from transfer.pull import PullSession

    cleaning, release, written = threading.Event(), threading.Event(), threading.Event()
    real_scatter, real_settle = transfer.pull.scatter_chunk, transfer.receiver.settle
    real_clean_up = PullSession._clean_up

    def held_scatter(*args):  # on the copy thread
        release.wait(30)
        time.sleep(0.3)  # (so a caller answered early would see the copy unfinished)
        real_scatter(*args)
        written.set()

    async def clean_up(self, reason):
        cleaning.set()
        await real_clean_up(self, reason)

    calls = []

    async def settle(tasks, timeout):
        calls.append(timeout)
        if len(calls) == 1:
            return False  # close's grace period ran out
        release.set()  # the copy may end now: after the cancel
        return await real_settle(tasks, timeout)

    monkeypatch.setattr(transfer.pull, "scatter_chunk", held_scatter)
    monkeypatch.setattr(PullSession, "_clean_up", clean_up)
    monkeypatch.setattr(transfer.receiver, "settle", settle)
    pair = Pair(config(zero_copy=False, pull_deadline_s=0.5, chunk_deadline_s=1.0))
    try:
        ticket, _ = pair.publish("r", 8)
        dst = pair.d.allocate("r", 8)
        results = []

        def pull() -> None:
            result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
            results.append((result, written.is_set()))

        puller = threading.Thread(target=pull)
        puller.start()
        assert cleaning.wait(20)  # failed, and waiting for its held copy
        pair.receiver.close()
        puller.join(30)
        ((result, copy_ended_first),) = results
        assert not result.ok
        assert copy_ended_first, "the caller got its pages back while a copy still wrote them"
        pair.d.free("r")
    finally:
        release.set()
        pair.sender.close()
