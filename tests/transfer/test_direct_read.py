"""Direct reads (transfer/direct_read.py) on CPU: a decode side in the prefill side's process reads
P's pages itself ("local"), checked against P's lease board before and after, with the same
leases, checks and accounting as UCX; a lease that ends during the read, or a ticket that names
other pages, fails the pull; a lease without a board slot goes over UCX. (Pool exports and
opening them: tests/transfer/test_ipc.py.)

Between two processes: on the CPU tests/transfer/test_direct_read_shm.py, over CUDA IPC (two GPUs)
tests/transfer/test_direct_read_gpu.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import transfer.direct_read
import transfer.done_board
import transfer.ipc
import transfer.links
import transfer.peer
from tests.transfer.conftest import config
from tests.transfer.test_transfer_local import Pair, cancel_pull, checked_pair, wait_until
from transfer.messages import ReadDone

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


def same_pages(pair: Pair, src: dict[str, list[int]], dst: dict[str, list[int]]) -> bool:
    """D's pages ``dst`` hold exactly P's pages ``src``, pool by pool."""
    got, want = pair.d.pages_of(dst), pair.p.pages_of(src)
    return all(torch.equal(got[g], want[g]) for g in src)


def test_pages_arrive_byte_exact_through_the_local_path(direct: Pair) -> None:
    result, src, dst = pull(direct, "d1", 22)  # 6 pages a group, two groups
    assert result.ok, result.error
    assert result.stats.path == "local"
    assert same_pages(direct, src, dst)
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
        assert not result.ok and "ended (expired, or released) before the read" in result.error
        assert all(torch.equal(pair.d.pages_of(dst)[g], before[g]) for g in dst)
        pair.d.free("d5")


def test_a_lease_that_ends_during_the_read_fails_the_pull(direct: Pair, monkeypatch) -> None:
    """P gives the pages back while D copies (here: cancelled mid-read): D's check after the copy
    sees the lease's word change and fails the pull, since the pages may have been reused."""
    real = transfer.direct_read.copy_on_cpu

    def cancelled_mid_read(*args):
        assert direct.sender.cancel("m1")  # P retires the lease and frees the pages
        return real(*args)

    monkeypatch.setattr(transfer.direct_read, "copy_on_cpu", cancelled_mid_read)
    result, _, _ = pull(direct, "m1", 8)
    assert not result.ok and "ended during the read" in result.error
    assert direct.p.released == ["m1"]
    direct.d.free("m1")


def test_a_ticket_naming_other_pages_is_refused_and_p_gets_its_pages(direct: Pair) -> None:
    ticket, src = direct.publish("t1", 8)
    forged = dataclasses.replace(ticket, page_ids={g: ids[::-1] for g, ids in src.items()})
    dst = direct.d.allocate("t1", 8)
    before = direct.d.pages_of(dst)
    result = direct.receiver.pull_blocking(forged, dst, 0, 8)
    assert not result.ok and "differ from the ones the prefill worker leased" in result.error
    assert all(torch.equal(direct.d.pages_of(dst)[g], before[g]) for g in dst)
    wait_until(lambda: direct.p.released == ["t1"])  # ReadDone(ok=False) released them now
    direct.d.free("t1")


def test_a_ticket_whose_ids_are_not_page_ids_fails_and_p_gets_its_pages(direct: Pair) -> None:
    ticket, src = direct.publish("m1", 8)
    broken = dataclasses.replace(ticket, page_ids={g: ["x"] + ids[1:] for g, ids in src.items()})
    dst = direct.d.allocate("m1", 8)
    before = direct.d.pages_of(dst)
    result = direct.receiver.pull_blocking(broken, dst, 0, 8)
    assert not result.ok and "not page ids" in result.error
    assert all(torch.equal(direct.d.pages_of(dst)[g], before[g]) for g in dst)
    # By ReadDone(ok=False) now: the lease would expire only after 10 s.
    wait_until(lambda: direct.p.released == ["m1"], timeout=3.0)
    direct.d.free("m1")


def test_a_lease_without_a_board_slot_goes_over_ucx_on_a_direct_link(direct: Pair) -> None:
    first, _, _ = pull(direct, "s0", 4)  # the link is up and direct
    assert first.ok and first.stats.path == "local"
    ticket, src = direct.publish("s1", 12)
    dst = direct.d.allocate("s1", 12)
    result = direct.receiver.pull_blocking(dataclasses.replace(ticket, lease_slot=-1), dst, 0, 12)
    assert result.ok and result.stats.path == "ucx"
    assert same_pages(direct, src, dst)
    wait_until(lambda: sorted(direct.p.released) == ["s0", "s1"])
    direct.d.free("s0")
    direct.d.free("s1")


def test_an_awaited_pull_reads_on_the_callers_event_loop(direct: Pair) -> None:
    pull(direct, "a0", 4)  # connects: from now on pulls of this peer skip the transceiver's loop
    ticket, src = direct.publish("a1", 10)
    dst = direct.d.allocate("a1", 10)

    async def go():
        return await direct.receiver.pull(ticket, dst, 0, 10)

    result = asyncio.run(go())
    assert result.ok and result.stats.path == "local"
    assert same_pages(direct, src, dst)
    wait_until(lambda: sorted(direct.p.released) == ["a0", "a1"])
    direct.d.free("a0")
    direct.d.free("a1")


def test_a_late_read_done_cannot_release_a_later_lease_of_the_same_request(direct: Pair) -> None:
    first, _ = direct.publish("again", 4)
    assert direct.sender.cancel("again")
    second, _ = direct.publish("again", 4)
    assert second.lease_gen != first.lease_gen
    late = ReadDone("again", first.lease_gen, True, "", 1, 1, "local")
    direct.sender.runtime.run(_deliver(direct, late), timeout=5)
    assert direct.sender.leases.get("again") is not None  # the second lease lives on
    result = direct.receiver.pull_blocking(second, direct.d.allocate("again", 4), 0, 4)
    assert result.ok, result.error
    wait_until(lambda: direct.p.released == ["again", "again"])
    direct.d.free("again")


async def _deliver(pair: Pair, msg: ReadDone) -> None:
    pair.sender.read_ends.on_read_done(msg)  # as if it came over a link, on the transceiver's loop


def test_a_copy_past_its_deadline_fails_the_pull_and_p_gets_its_pages(
    direct: Pair, monkeypatch
) -> None:
    pull(direct, "w", 4)  # connects: the next pull runs on this thread
    monkeypatch.setattr(transfer.direct_read, "wait_copy_blocking", lambda event, timeout: False)
    result, _, _ = pull(direct, "late", 8)
    assert not result.ok and "did not end within" in result.error
    wait_until(lambda: sorted(direct.p.released) == ["late", "w"])  # ReadDone(ok=False) for late
    direct.d.free("w")
    direct.d.free("late")


def test_pools_that_fail_to_open_leave_the_link_on_ucx(monkeypatch) -> None:
    def broken(*_args):
        raise RuntimeError("driver says no")

    monkeypatch.setattr(transfer.links, "open_pools", broken)
    with checked_pair(config(direct_copy=True)) as pair:
        result, src, dst = pull(pair, "b1", 8)
        assert result.ok and result.stats.path == "ucx"
        assert same_pages(pair, src, dst)
        # D closed the done board it offered: P stops polling it (it would, every millisecond
        # while it holds a lease, for the life of the link).
        wait_until(lambda: not pair.sender.read_ends._links)
        pair.d.free("b1")


def test_a_direct_read_counts_as_in_flight_on_a_links_first_pull(direct: Pair, monkeypatch) -> None:
    seen, real = [], transfer.direct_read.copy_on_cpu

    def sampling(*args):
        seen.append(direct.receiver.stats()["pulls_in_flight"])
        return real(*args)

    monkeypatch.setattr(transfer.direct_read, "copy_on_cpu", sampling)
    for rid in ("first", "second"):  # connecting first, then straight on the caller's thread
        result, _, _ = pull(direct, rid, 8)
        assert result.ok and result.stats.path == "local"
        direct.d.free(rid)
    assert seen == [1, 1]


def test_pools_smaller_than_their_page_table_leave_the_link_on_ucx(monkeypatch) -> None:
    # The copy kernel skips ids past the rows it is given, so rows shorter than P's page table
    # would turn good ids into skipped pages: such pools are not used for direct reads.
    real = transfer.links.open_pools

    def truncated(export, own_rows):
        path, rows = real(export, own_rows)
        return path, {name: r[: r.shape[0] // 2] for name, r in rows.items()}

    monkeypatch.setattr(transfer.links, "open_pools", truncated)
    with checked_pair(config(direct_copy=True)) as pair:
        result, src, dst = pull(pair, "t1", 8)
        assert result.ok and result.stats.path == "ucx"
        assert same_pages(pair, src, dst)
        pair.d.free("t1")


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
        assert same_pages(direct, src, dsts[rid])
        direct.d.free(rid)
    wait_until(lambda: len(direct.p.released) == n)


def test_off_keeps_the_ucx_path() -> None:
    with checked_pair(config(direct_copy=False)) as pair:
        result, _, _ = pull(pair, "u1", 8)
        assert result.ok and result.stats.path == "ucx"
        pair.d.free("u1")


def test_a_read_that_succeeds_sends_no_message_and_one_that_fails_says_why(
    direct: Pair, monkeypatch
) -> None:
    """Success is a record on D's done board, which P polls; a failure is ReadDone with the
    reason, which P records."""
    posted: list[object] = []
    real_post = transfer.peer.PeerLink.post
    monkeypatch.setattr(
        transfer.peer.PeerLink, "post", lambda self, msg: (posted.append(msg), real_post(self, msg))
    )
    result, _, _ = pull(direct, "n1", 12)
    assert result.ok, result.error
    wait_until(lambda: direct.p.released == ["n1"])
    assert posted == []
    direct.d.free("n1")
    result, _, _ = pull(direct, "n2", 12, expected=13)
    assert not result.ok
    wait_until(lambda: direct.p.released == ["n1", "n2"])
    assert [type(m).__name__ for m in posted] == ["ReadDone"]
    failed = [s for s in direct.sender.drain_transfer_stats() if not s.ok]
    assert len(failed) == 1 and "declared history mismatch" in failed[0].error
    direct.d.free("n2")


def test_without_p_reading_the_done_board_reads_end_with_read_done(monkeypatch) -> None:
    def refuse(path: str) -> None:
        raise transfer.done_board.DoneBoardUnavailable("not here")

    monkeypatch.setattr(transfer.peer, "DoneBoardView", refuse)
    with checked_pair(config(direct_copy=True)) as pair:
        result, src, dst = pull(pair, "r1", 12)
        assert result.ok and result.stats.path == "local"
        assert same_pages(pair, src, dst)
        wait_until(lambda: pair.p.released == ["r1"])  # by ReadDone
        assert pair.sender.stats()["expired_leases"] == 0
        pair.d.free("r1")


def test_a_cancelled_host_read_returns_only_after_its_copy_ended(direct: Pair, monkeypatch) -> None:
    """The caller frees its pages once the pull returns: on the CPU the copy runs on the copy
    thread, and a cancel must not return while it still writes them, nor a second cancel (a
    timeout, then a shutdown) while the first one waits for the copy."""
    pull(direct, "c0", 4)[0]  # the link is up and direct: the next pull runs on our loop
    direct.d.free("c0")
    real = transfer.direct_read.copy_on_cpu
    ended = threading.Event()

    def slow_copy(*args):
        time.sleep(0.3)
        real(*args)
        ended.set()

    monkeypatch.setattr(transfer.direct_read, "copy_on_cpu", slow_copy)
    ticket, _ = direct.publish("c1", 8)
    dst = direct.d.allocate("c1", 8)

    cancel_pull(direct.receiver, ticket, dst, 8, after_s=0.05, cancels=2)
    assert ended.is_set()
    direct.d.free("c1")
    wait_until(lambda: "c1" in direct.p.released, timeout=2.0)  # ReadDone(ok=False), no expiry
    assert direct.sender.stats()["expired_leases"] == 0


def test_a_pull_cancelled_while_connecting_reads_nothing_afterwards(
    direct: Pair, monkeypatch
) -> None:
    """A cancel before the link is up returns at once (nothing can write the pages yet), so the
    pull must not start a direct read once the link comes up: the caller already has the pages
    back. P hears of it (the negative ack) and frees its own."""
    real_connect = transfer.links.connect

    async def slow_connect(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(transfer.links, "connect", slow_connect)
    ticket, _ = direct.publish("c1", 8)
    dst = direct.d.allocate("c1", 8)

    cancel_pull(direct.receiver, ticket, dst, 8, after_s=0.1)
    for g, ids in dst.items():  # the caller reuses the pages
        direct.d.kv.buffers[g][ids] = 0
    wait_until(lambda: direct.receiver.stats()["failures"] == 1)  # the link came up meanwhile
    wait_until(lambda: "c1" in direct.p.released, timeout=2.0)  # by the negative ack
    assert all(not direct.d.pages_of(dst)[g].any() for g in dst)
    assert direct.receiver.stats()["transfers_ok"] == 0
    direct.d.free("c1")
