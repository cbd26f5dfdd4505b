"""Direct reads between two processes on the CPU ("host_shm"): P's pools move into /dev/shm when it
starts, D opens them from the handshake and reads P's pages itself, checked against P's lease board
before and after. The bytes arrive exact in other pages, concurrent reads do not mix, a
declared-history mismatch and an expired lease fail with both sides' pages back, a killed P ends in
a clear result within the deadline, and a P whose pools cannot be shared is pulled over UCX."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.transfer.conftest import KVSide, config, specs
from tests.transfer.peer_process import run_prefill
from tests.transfer.test_transfer_local import wait_until
from tests.transfer.test_transfer_processes import Peer, as_tensor, concurrent_pulls
from transfer import KVReceiver, TransferResult

pytestmark = pytest.mark.timeout(120)

TWO = {"two_groups": True}


@pytest.fixture
def decode_side() -> Iterator[tuple[KVSide, KVReceiver]]:
    side = KVSide(specs(**TWO), seed=32)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, "tiny-test-model", config(direct_copy=True))
    yield side, receiver
    receiver.close()
    side.assert_clean()


def start_peer(seed: int, **cfg: object) -> Peer:
    return Peer(run_prefill, seed, TWO, {"direct_copy": True, **cfg})


def pull_exact(peer: Peer, side: KVSide, receiver: KVReceiver, rid: str, n: int) -> TransferResult:
    ticket, sent = peer.ask("publish", rid, n)
    dst = side.allocate(rid, n)
    assert dst != ticket.page_ids
    result = receiver.pull_blocking(ticket, dst, 0, n)
    assert result.ok, result.error
    for group, got in side.pages_of(dst).items():
        assert torch.equal(got, as_tensor(sent[group], got)), group
    side.free(rid)
    return result


def released_all(peer: Peer) -> bool:
    state = peer.ask("state")
    return state["free"] == state["initial_free"]


def test_scattered_pages_arrive_exact_and_p_gets_them_back(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(31)
    try:
        for i, tokens in enumerate((3, 22, 200)):  # 1 page, 6 pages, 50 pages (25 UCX chunks)
            result = pull_exact(peer, side, receiver, f"s{i}", tokens)
            assert result.stats.path == "host_shm" and result.stats.chunks == 1
        (link,) = receiver.links.open.values()
        assert link.access is not None and link.access.done is not None  # P reads our board
        wait_until(lambda: released_all(peer))  # by the done board, not lease expiry
        stats = peer.ask("state")["stats"]
        assert stats["expired_leases"] == 0 and stats["transfers_ok"] == 3
        board = link.access.done
        receiver.runtime.loop.call_soon_threadsafe(link.abort, "the test closes the link")
        wait_until(lambda: board._closed)  # the link's end closes our done board
    finally:
        state = peer.close()
    assert state["free"] == state["initial_free"]


def test_concurrent_reads_do_not_mix(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(33)
    try:
        results = concurrent_pulls(peer, side, receiver, "c", 30)
        assert {r.stats.path for r in results.values()} == {"host_shm"}
        wait_until(lambda: released_all(peer))
        assert peer.ask("state")["stats"]["expired_leases"] == 0
    finally:
        peer.close()


def test_declared_history_mismatch_fails_and_both_sides_get_their_pages(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(34)
    try:
        ticket, _ = peer.ask("publish", "m1", 10)
        dst = side.allocate("m1", 11)
        result = receiver.pull_blocking(ticket, dst, 0, 11)  # D expected 11 tokens, P declares 10
        assert not result.ok and "declared" in result.error
        assert result.stats.path == "host_shm"
        side.free("m1")
        wait_until(lambda: released_all(peer))  # at once, by ReadDone(ok=False)
        pull_exact(peer, side, receiver, "m2", 10)  # the next one goes through
    finally:
        state = peer.close()
    assert state["stats"]["expired_leases"] == 0


def test_expired_lease_is_refused_from_the_board(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(35, lease_s=1.5)
    try:
        pull_exact(peer, side, receiver, "e0", 8)  # the link exists: the next pull is direct
        ticket, _ = peer.ask("publish", "e1", 8)
        wait_until(lambda: released_all(peer))  # the lease expired, P took its pages back
        dst = side.allocate("e1", 8)
        result = receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok and "ended" in result.error, result.error
        side.free("e1")
        pull_exact(peer, side, receiver, "e2", 8)
        assert peer.ask("state")["stats"]["expired_leases"] == 1
    finally:
        peer.close()


def test_a_killed_prefill_process_ends_the_pull_and_the_next_one_succeeds(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(36)
    pull_exact(peer, side, receiver, "k0", 8)
    ticket, sent = peer.ask("publish", "k1", 40)
    peer.kill()
    dst = side.allocate("k1", 40)
    result = receiver.pull_blocking(ticket, dst, 0, 40)  # bounded by the deadlines in config()
    if result.ok:
        # P's pages were final when it published the lease and nobody can reuse them now: the
        # read may still complete from the shared memory, and then it is exact.
        for group, got in side.pages_of(dst).items():
            assert torch.equal(got, as_tensor(sent[group], got)), group
    else:
        assert result.error
    side.free("k1")
    again = start_peer(37)
    try:
        pull_exact(again, side, receiver, "k2", 8)
    finally:
        again.close()


def test_pools_that_cannot_be_shared_are_pulled_over_ucx(decode_side) -> None:
    side, receiver = decode_side
    peer = start_peer(38, no_sharing=True)
    try:
        result = pull_exact(peer, side, receiver, "u1", 22)
        assert result.stats.path == "ucx"
    finally:
        state = peer.close()
    assert state["free"] == state["initial_free"]
