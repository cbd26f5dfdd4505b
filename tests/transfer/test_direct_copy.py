"""The direct-copy data path (transfer/ipc.py) on CPU: a prefill side in the decode side's process
writes D's pages itself ("local"), with the same protocol, leases, checks and accounting as UCX;
a peer in another process falls back to UCX; pool exports decode strictly.

The CUDA IPC variant (two processes, two GPUs) is tests/transfer/test_direct_copy_gpu.py."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.conftest import KVSide, config, specs
from tests.transfer.peer_process import run_prefill
from tests.transfer.test_transfer_local import Pair, checked_pair, wait_until
from tests.transfer.test_transfer_processes import Peer, as_tensor
from transfer import KVReceiver
from transfer.ipc import IpcExport, IpcPool, IpcUnavailable, export_pools

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def direct() -> Iterator[Pair]:
    with checked_pair(config(direct_copy=True), two_groups=True) as made:
        yield made


def pull(pair: Pair, rid: str, tokens: int, expected: int | None = None):
    ticket, src = pair.publish(rid, tokens)
    dst = pair.d.allocate(rid, tokens)
    assert dst != src
    result = pair.receiver.pull_blocking(ticket, dst, 0, tokens if expected is None else expected)
    return result, src, dst


def test_pages_arrive_byte_exact_through_the_local_path(direct: Pair) -> None:
    result, src, dst = pull(direct, "d1", 22)  # 6 pages a group, two groups
    assert result.ok, result.error
    assert result.stats.path == "local"
    for g in src:
        assert torch.equal(direct.d.pages_of(dst)[g], direct.p.pages_of(src)[g])
    assert result.bytes == sum(len(src[g]) * s.page_bytes for g, s in zip(src, direct.p.specs))
    assert result.stats.chunks == 1  # one copy, whatever the staging size
    wait_until(lambda: direct.p.released == ["d1"])  # acked: P's pages are back
    sent = direct.sender.drain_transfer_stats()
    assert [(s.path, s.ok, s.bytes) for s in sent] == [("local", True, result.bytes)]
    assert direct.sender.stats()["peers"] == 1
    direct.d.free("d1")


def test_untouched_pages_stay_untouched(direct: Pair) -> None:
    before = {g: b.clone() for g, b in direct.d.kv.buffers.items()}
    result, _, dst = pull(direct, "d2", 9)
    assert result.ok, result.error
    for g, buf in direct.d.kv.buffers.items():
        changed = (buf != before[g]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= set(dst[g])
    direct.d.free("d2")


def test_skip_pages_copies_only_the_rest(direct: Pair) -> None:
    ticket, src = direct.publish("d3", 16)  # 4 pages a group
    dst = {g: ids[2:] for g, ids in direct.d.allocate("d3", 16).items()}
    result = direct.receiver.pull_blocking(ticket, dst, 2, 16)
    assert result.ok, result.error
    for g in src:
        assert torch.equal(direct.d.pages_of(dst)[g], direct.p.pages_of({g: src[g][2:]})[g])
    direct.d.free("d3")


def test_declared_history_mismatch_fails_and_both_sides_get_their_pages(direct: Pair) -> None:
    result, _, _ = pull(direct, "d4", 12, expected=13)
    assert not result.ok and "declared history mismatch" in result.error
    direct.d.free("d4")
    wait_until(lambda: "d4" in direct.p.released)  # D's negative ack gave P its pages back


def test_an_expired_lease_is_refused_before_any_copy() -> None:
    with checked_pair(config(direct_copy=True, lease_s=0.3)) as pair:
        ticket, _ = pair.publish("d5", 8)
        wait_until(lambda: pair.p.released == ["d5"], timeout=5.0)
        dst = pair.d.allocate("d5", 8)
        before = pair.d.pages_of(dst)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok and "(expired)" in result.error
        assert all(torch.equal(pair.d.pages_of(dst)[g], before[g]) for g in dst)
        pair.d.free("d5")


def test_concurrent_pulls_do_not_mix(direct: Pair) -> None:
    n = 20
    tickets = {f"c{i}": direct.publish(f"c{i}", 4 + i) for i in range(n)}
    dsts = {rid: direct.d.allocate(rid, 4 + i) for i, rid in enumerate(tickets)}
    results: dict[str, object] = {}

    def one(rid: str, tokens: int) -> None:
        results[rid] = direct.receiver.pull_blocking(tickets[rid][0], dsts[rid], 0, tokens)

    threads = [threading.Thread(target=one, args=(rid, 4 + i)) for i, rid in enumerate(tickets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rid, (_, src) in tickets.items():
        assert results[rid].ok, results[rid].error
        got, want = direct.d.pages_of(dsts[rid]), direct.p.pages_of(src)
        assert all(torch.equal(got[g], want[g]) for g in src)
        direct.d.free(rid)
    wait_until(lambda: len(direct.p.released) == n)


def test_off_keeps_the_ucx_path() -> None:
    with checked_pair(config(direct_copy=False)) as pair:
        result, _, _ = pull(pair, "u1", 8)
        assert result.ok and result.stats.path == "ucx"
        pair.d.free("u1")


def test_a_peer_in_another_process_falls_back_to_ucx() -> None:
    """On CPU there is no CUDA IPC: the export only names our process, P sees that and stays on
    UCX, and the transfer is as exact as ever."""
    peer = Peer(run_prefill, 21, {}, {"direct_copy": True})
    side = KVSide(specs(), seed=22)
    side.scramble_free_queue()
    receiver = KVReceiver(side.kv.buffers, side.specs, "tiny-test-model", config(direct_copy=True))
    try:
        ticket, sent = peer.ask("publish", "x1", 10)
        dst = side.allocate("x1", 10)
        result = receiver.pull_blocking(ticket, dst, 0, 10)
        assert result.ok, result.error
        assert result.stats.path == "ucx"
        got = side.pages_of(dst)["full"]
        assert torch.equal(got, as_tensor(sent["full"], got))
        side.free("x1")
    finally:
        receiver.close()
        state = peer.close()
    assert state["free"] == state["initial_free"]
    side.assert_clean()


def test_pool_exports_round_trip_and_reject_garbage() -> None:
    side = KVSide(specs(), seed=4)
    rows = {
        g: b.view(-1).view(torch.uint8).view(b.shape[0], -1) for g, b in side.kv.buffers.items()
    }
    export = export_pools(rows, cuda_ipc=True)  # CPU pools: registry only, no handles
    assert export.device == "cpu" and export.pools == ()
    assert IpcExport.from_wire(export.to_wire()) == export
    pool = IpcPool("full", b"h", 1, 0, b"r", 0, 0, 1, 1)
    with_pool = dataclasses.replace(export, pools=(pool,))
    assert IpcExport.from_wire(with_pool.to_wire()) == with_pool
    for garbage in (b"", b"\xc1", b"\x93\x01\x02\x03", with_pool.to_wire()[:-3]):
        with pytest.raises(IpcUnavailable, match="malformed pool export"):
            IpcExport.from_wire(garbage)
    wrong_type = dataclasses.replace(with_pool, pools=(dataclasses.replace(pool, nbytes="1"),))
    with pytest.raises(IpcUnavailable, match="nbytes"):
        IpcExport.from_wire(wrong_type.to_wire())
