"""KVSender and KVReceiver in one process, over real UCX (TCP loopback) and a real control socket:
byte-exact transfers, chunking, skip_pages, concurrency, and the checks that fail a pull."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender, TransceiverConfig

pytestmark = pytest.mark.timeout(60)


class Pair:
    def __init__(self, cfg: TransceiverConfig, two_groups: bool = False) -> None:
        self.p = KVSide(specs(two_groups=two_groups), seed=1)
        self.d = KVSide(specs(two_groups=two_groups), seed=2)
        self.p.scramble_free_queue()
        self.d.scramble_free_queue()
        self.sender = KVSender(self.p.kv.buffers, self.p.specs, MODEL, cfg, self.p.release)
        self.receiver = KVReceiver(self.d.kv.buffers, self.d.specs, MODEL, cfg)

    def publish(self, rid: str, num_tokens: int, declared: int | None = None):
        pages = self.p.allocate(rid, num_tokens)
        return self.sender.publish(rid, pages, num_tokens if declared is None else declared), pages

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@contextlib.contextmanager
def checked_pair(cfg: TransceiverConfig, two_groups: bool = False) -> Iterator[Pair]:
    """A Pair that is closed afterwards, and then must have every page back on both sides."""
    made = Pair(cfg, two_groups)
    try:
        yield made
    finally:
        made.close()
    made.p.assert_clean()
    made.d.assert_clean()


@pytest.fixture
def pair() -> Iterator[Pair]:
    with checked_pair(config()) as made:
        yield made


def cancel_pull(receiver, ticket, dst, tokens: int, after_s: float, cancels: int = 1) -> None:
    """Await ``receiver.pull`` on a new event loop and cancel it ``cancels`` times, the first
    after ``after_s``; returns once the cancel reached the caller, as it must (CancelledError)."""

    async def run() -> None:
        task = asyncio.ensure_future(receiver.pull(ticket, dst, 0, tokens))
        for _ in range(cancels):
            await asyncio.sleep(after_s)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_random_kv_arrives_byte_exact_in_other_pages(pair: Pair) -> None:
    ticket, src = pair.publish("r1", 22)  # 6 pages of 4 tokens, 3 chunks of 2 pages
    dst = pair.d.allocate("r1", 22)
    assert src != dst
    result = pair.receiver.pull_blocking(ticket, dst, 0, 22)
    assert result.ok, result.error
    assert result.stats.chunks == 3 and result.bytes == 6 * pair.p.specs[0].page_bytes
    assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])
    wait_until(lambda: pair.p.released == ["r1"])
    assert pair.sender.stats()["expired_leases"] == 0  # it was the ack that freed P's pages
    pair.d.free("r1")


@pytest.mark.parametrize("zero_copy", [True, False])
def test_two_pool_groups_skip_pages_and_staging_paths(zero_copy: bool) -> None:
    cfg = config(zero_copy=zero_copy, staging_tokens=12, staging_buffers=1)
    with checked_pair(cfg, two_groups=True) as made:
        ticket, src = made.publish("r2", 40)  # 10 pages per group
        with made.d.lock:  # D's pages in one run per group, so zero_copy can skip staging
            assert made.d.kv.allocate_slots("r2", 40)
            all_dst = made.d.kv.page_ids("r2")
        before = made.d.pages_of(all_dst)
        dst = {g: ids[3:] for g, ids in all_dst.items()}
        result = made.receiver.pull_blocking(ticket, dst, 3, 40)
        assert result.ok, result.error
        after, sent = made.d.pages_of(all_dst), made.p.pages_of(src)
        for g in all_dst:
            assert torch.equal(after[g][:3], before[g][:3])  # skipped pages untouched
            assert torch.equal(after[g][3:], sent[g][3:])
        wait_until(lambda: made.p.released == ["r2"])
        made.d.free("r2")


@pytest.mark.parametrize("one_run", ["p", "d"])
def test_a_side_whose_pages_are_one_run_sends_or_receives_without_its_copy(
    one_run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh pages on one side (one run), scattered on the other: the run's side moves its chunks
    straight from / into its pool, the other still stages them (as GPU pools do: host pools would
    list their scattered pages instead, ``host_iov``, tested below), and the bytes arrive exact."""
    import transfer.prestage
    import transfer.pull
    import transfer.serve

    copies: list[str] = []

    def counted(real, name: str):
        def copy(*args):  # the real copy, counted
            copies.append(name)
            return real(*args)

        return copy

    for module, name in (
        (transfer.serve, "gather_chunk"),
        (transfer.prestage, "gather_chunk"),
        (transfer.pull, "scatter_chunk"),
    ):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    p, d = KVSide(specs(), seed=1), KVSide(specs(), seed=2)
    (d if one_run == "p" else p).scramble_free_queue()
    cfg = config(staging_tokens=16, staging_buffers=2, host_iov=False)
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    try:
        src, dst = p.allocate("r", 64), d.allocate("r", 64)
        runs = src["full"] if one_run == "p" else dst["full"]
        assert runs == list(range(runs[0], runs[0] + len(runs)))  # the fresh side is one run
        result = receiver.pull_blocking(sender.publish("r", src, 64), dst, 0, 64)
        assert result.ok, result.error
        assert result.stats.chunks > 1
        assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"])
        expected = "scatter_chunk" if one_run == "p" else "gather_chunk"
        assert copies and set(copies) == {expected}, copies
        wait_until(lambda: p.released == ["r"])
        d.free("r")
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_concurrent_pulls_into_one_run_share_the_staging_of_scattered_pages() -> None:
    """D's pages are one run, so D credits every chunk at once; P has one staging buffer for the
    chunks of four concurrent pulls of scattered pages: each pull waits its turn, none hangs."""
    p, d = KVSide(specs(), seed=1), KVSide(specs(), seed=2)
    p.scramble_free_queue()
    sender = KVSender(p.kv.buffers, p.specs, MODEL, config(staging_buffers=1), p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config(staging_tokens=16))
    try:
        jobs = {f"q{i}": (p.allocate(f"q{i}", 48), d.allocate(f"q{i}", 48)) for i in range(4)}
        tickets = {rid: sender.publish(rid, src, 48) for rid, (src, _) in jobs.items()}
        results: dict[str, object] = {}

        def run(rid: str) -> None:
            results[rid] = receiver.pull_blocking(tickets[rid], jobs[rid][1], 0, 48)

        threads = [threading.Thread(target=run, args=(rid,)) for rid in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=50)
        assert all(r.ok for r in results.values()) and len(results) == 4, results
        for rid, (src, dst) in jobs.items():
            assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"]), rid
            d.free(rid)
        wait_until(lambda: sorted(p.released) == sorted(jobs))
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_fifty_concurrent_transfers_do_not_mix(pair: Pair) -> None:
    tickets = {}
    for i in range(50):
        tickets[f"c{i}"] = pair.publish(f"c{i}", 4 + (i % 5) * 4)
    dsts = {rid: pair.d.allocate(rid, 4 + (i % 5) * 4) for i, rid in enumerate(tickets)}
    results: dict[str, object] = {}

    def run(rid: str) -> None:
        ticket, _ = tickets[rid]
        results[rid] = pair.receiver.pull_blocking(ticket, dsts[rid], 0, ticket.declared_prompt_len)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in tickets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert all(r.ok for r in results.values()), [r.error for r in results.values() if not r.ok]
    for rid, (_, src) in tickets.items():
        assert torch.equal(pair.d.pages_of(dsts[rid])["full"], pair.p.pages_of(src)["full"]), rid
        pair.d.free(rid)
    wait_until(lambda: sorted(pair.p.released) == sorted(tickets))
    assert pair.receiver.stats()["transfers_ok"] == 50


def test_async_pull_from_another_event_loop(pair: Pair) -> None:
    import asyncio

    ticket, src = pair.publish("a1", 8)
    dst = pair.d.allocate("a1", 8)
    result = asyncio.run(pair.receiver.pull(ticket, dst, 0, 8))
    assert result.ok and result.status == "ok"
    assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])
    pair.d.free("a1")
    wait_until(lambda: pair.p.released == ["a1"])


def test_declared_history_mismatch_in_ticket_fails_and_frees_both_sides(pair: Pair) -> None:
    ticket, _ = pair.publish("m1", 12)
    dst = pair.d.allocate("m1", 12)
    result = pair.receiver.pull_blocking(ticket, dst, 0, 13)
    assert not result.ok and result.status == "failed"
    assert (
        "declared history mismatch" in result.error
        and "12" in result.error
        and "13" in result.error
    )
    pair.d.free("m1")  # D's caller frees its pages on failure
    wait_until(lambda: pair.p.released == ["m1"])  # D's negative ack frees P's at once


def test_declared_history_mismatch_in_transfer_done_fails_after_the_bytes(pair: Pair) -> None:
    # The router's copy of the ticket says 12; P itself declared 11 when it published.
    ticket, _ = pair.publish("m2", 12, declared=11)
    ticket = dataclasses.replace(ticket, declared_prompt_len=12)
    dst = pair.d.allocate("m2", 12)
    result = pair.receiver.pull_blocking(ticket, dst, 0, 12)
    assert not result.ok
    assert "declared history mismatch: P declares 11 prompt tokens, expected 12" in result.error
    pair.d.free("m2")
    wait_until(lambda: pair.p.released == ["m2"])
    assert pair.sender.stats()["leases"] == 0
    # The link stays usable: the next transfer succeeds.
    ticket, src = pair.publish("m3", 8)
    dst = pair.d.allocate("m3", 8)
    assert pair.receiver.pull_blocking(ticket, dst, 0, 8).ok
    pair.d.free("m3")


def test_wrong_number_of_destination_pages_fails_before_any_byte_moves(pair: Pair) -> None:
    ticket, _ = pair.publish("w1", 12)
    dst = pair.d.allocate("w1", 8)  # 2 pages for 3
    result = pair.receiver.pull_blocking(ticket, dst, 0, 12)
    assert not result.ok and "3 destination pages are needed, got 2" in result.error
    pair.d.free("w1")
    assert pair.sender.cancel("w1")  # the router gives up the request: P frees at once
    assert pair.p.released == ["w1"]


def test_second_pull_of_a_finished_request_is_refused(pair: Pair) -> None:
    ticket, _ = pair.publish("twice", 8)
    dst = pair.d.allocate("twice", 8)
    assert pair.receiver.pull_blocking(ticket, dst, 0, 8).ok
    wait_until(lambda: pair.p.released == ["twice"])
    again = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert not again.ok and "already released (acked)" in again.error
    pair.d.free("twice")
