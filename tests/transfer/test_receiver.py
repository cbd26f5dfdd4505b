"""KVSender and KVReceiver in one process over a real control socket, on each data path this CPU
machine runs (UCX over TCP loopback, and shared memory): byte-exact scattered pages, chunks,
skipped pages per group, 50 concurrent pulls, pulls from other event loops and cancelled pulls,
and the checks that fail a pull before any byte moves."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.transfer.conftest import Pair, checked_pair, wait_until
from transfer.paths import staging

pytestmark = pytest.mark.timeout(60)


def test_scattered_pages_arrive_byte_exact_in_other_pages(pair: Pair) -> None:
    result, src, dst = pair.pull("r1", 22)  # 6 pages of 4 tokens (3 chunks of 2 pages over UCX)
    assert result.ok, result.error
    assert src != dst and pair.same(src, dst)
    assert result.bytes == 6 * pair.p.specs[0].page_bytes
    if staging.RUN_PAGE_BYTES == 0:  # in place: a chunk per run of pages consecutive on both sides
        s, d = np.array(src["full"]), np.array(dst["full"])
        runs = 1 + int(((np.diff(s) != 1) | (np.diff(d) != 1)).sum())
        assert result.stats.chunks == runs > 1
        # No staging on either side: UCX read P's pages and wrote D's.
        assert pair.receiver.staging.count and not pair.receiver.staging._made
        assert not pair.sender.staging._made
    else:
        assert result.stats.chunks == (3 if result.stats.path == "ucx" else 1)
    wait_until(lambda: pair.p.released == ["r1"])  # D's final notice freed P's pages
    assert pair.sender.stats()["expired_leases"] == 0
    pair.d.free("r1")


@pytest.mark.parametrize("consecutive_on", ["P", "D"])
def test_ucx_moves_one_side_in_place_and_stages_the_other(consecutive_on: str) -> None:
    """Small pages (staged plan): a chunk whose pages are one stretch of a side's pool skips that
    side's copy, while the other side gathers or scatters it; the bytes arrive exact."""
    with checked_pair("ucx") as made:
        side = made.p if consecutive_on == "P" else made.d
        side.scramble_free_queue(ordered=True)
        result, src, dst = made.pull("o1", 24)  # 6 pages, 3 chunks of 2
        assert result.ok, result.error
        assert made.same(src, dst)
        held = src if consecutive_on == "P" else dst
        assert held["full"] == list(range(held["full"][0], held["full"][0] + 6))
        staged, in_place = (made.receiver, made.sender)[:: 1 if consecutive_on == "P" else -1]
        assert staged.staging._made and not in_place.staging._made
        made.d.free("o1")
        wait_until(lambda: made.p.released == ["o1"])


@pytest.mark.parametrize("path", ["ucx", "host_shm"])
def test_two_groups_and_skipped_pages_per_group(path: str) -> None:
    with checked_pair(path, two_groups=True) as made:
        ticket, src = made.publish("r2", 40)  # 10 pages per group
        all_dst = made.d.allocate("r2", 40)
        before = made.d.pages_of(all_dst)
        skip = {"full": 3, "extra": 5}  # (a window group would skip more of its pages)
        dst = {g: ids[skip[g] :] for g, ids in all_dst.items()}
        result = made.receiver.pull_blocking(ticket, dst, skip, 40)
        assert result.ok, result.error
        after, sent = made.d.pages_of(all_dst), made.p.pages_of(src)
        for g in all_dst:
            assert torch.equal(after[g][: skip[g]], before[g][: skip[g]])  # skipped: untouched
            assert torch.equal(after[g][skip[g] :], sent[g][skip[g] :])
        wait_until(lambda: made.p.released == ["r2"])
        made.d.free("r2")


def test_pages_outside_the_pull_stay_untouched(pair: Pair) -> None:
    before = {g: b.clone() for g, b in pair.d.kv.buffers.items()}
    result, _, dst = pair.pull("r3", 9)
    assert result.ok, result.error
    for g, buf in pair.d.kv.buffers.items():
        changed = (buf != before[g]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= set(dst[g])
    pair.d.free("r3")


def test_fifty_concurrent_pulls_do_not_mix(pair: Pair) -> None:
    sizes = {f"c{i}": 4 + (i % 5) * 4 for i in range(50)}
    published = {rid: pair.publish(rid, n) for rid, n in sizes.items()}
    dsts = {rid: pair.d.allocate(rid, n) for rid, n in sizes.items()}
    results: dict[str, object] = {}

    def run(rid: str) -> None:
        ticket, _ = published[rid]
        results[rid] = pair.receiver.pull_blocking(ticket, dsts[rid], 0, sizes[rid])

    threads = [threading.Thread(target=run, args=(rid,)) for rid in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert all(r.ok for r in results.values()), [r.error for r in results.values() if not r.ok]
    for rid, (_, src) in published.items():
        assert pair.same(src, dsts[rid]), rid
        pair.d.free(rid)
    wait_until(lambda: sorted(pair.p.released) == sorted(sizes))
    assert pair.receiver.stats()["transfers_ok"] == 50


def test_pulls_from_another_event_loop_and_concurrent_awaits(pair: Pair) -> None:
    jobs = {f"a{i}": pair.publish(f"a{i}", 12) for i in range(4)}
    dsts = {rid: pair.d.allocate(rid, 12) for rid in jobs}

    async def main() -> list:
        return await asyncio.gather(
            *(pair.receiver.pull(t, dsts[rid], 0, 12) for rid, (t, _) in jobs.items())
        )

    results = asyncio.run(main())
    assert all(r.ok and r.status == "ok" for r in results)
    for rid, (_, src) in jobs.items():
        assert pair.same(src, dsts[rid])
        pair.d.free(rid)
    wait_until(lambda: len(pair.p.released) == 4)


def test_a_cancelled_pull_returns_only_once_it_is_over(pair: Pair) -> None:
    """The caller's CancelledError comes after the pull ended: the pages are safe to free then,
    and P gets its pages back (D's negative notice, or the pull completed first)."""
    ticket, _ = pair.publish("x", 64)
    dst = pair.d.allocate("x", 64)

    async def main() -> None:
        task = asyncio.ensure_future(pair.receiver.pull(ticket, dst, 0, 64))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pair.receiver.stats()["pulls_in_flight"] == 0

    asyncio.run(main())
    pair.d.free("x")
    wait_until(lambda: pair.p.released == ["x"])
    pair.pull_ok("after")


def test_a_ticket_with_another_compat_hash_fails_at_once(pair: Pair) -> None:
    ticket, _ = pair.publish("h", 8)
    dst = pair.d.allocate("h", 8)
    forged = dataclasses.replace(ticket, compat_hash="0" * 16)
    result = pair.receiver.pull_blocking(forged, dst, 0, 8)
    assert not result.ok and "compatibility hash mismatch" in result.error
    pair.d.free("h")
    wait_until(lambda: pair.p.released == ["h"])  # D gave the ticket up: P frees at once
    pair.pull_ok("after")


def test_declared_history_mismatch_fails_and_frees_both_sides(pair: Pair) -> None:
    result, _, _ = pair.pull("m1", 12, expected=13)  # the ticket says 12, D expects 13
    assert not result.ok
    assert "declared history mismatch: P declares 12 prompt tokens, expected 13" in result.error
    pair.d.free("m1")
    wait_until(lambda: pair.p.released == ["m1"])
    # P's own lease declares 11 while the ticket says 12: P refuses it at admission.
    ticket, _ = pair.publish("m2", 12, declared=11)
    dst = pair.d.allocate("m2", 12)
    result = pair.receiver.pull_blocking(
        dataclasses.replace(ticket, declared_prompt_len=12), dst, 0, 12
    )
    assert not result.ok
    assert "declared history mismatch: P declares 11 prompt tokens, expected 12" in result.error
    pair.d.free("m2")
    wait_until(lambda: "m2" in pair.p.released)  # the request is lost: its pages go
    assert pair.sender.stats()["leases"] == 0
    pair.pull_ok("after")  # the link stays usable


def test_the_wrong_number_of_destination_pages_fails_before_any_byte(pair: Pair) -> None:
    ticket, _ = pair.publish("w", 12)
    dst = pair.d.allocate("w", 8)  # 2 pages for 3
    before = pair.d.pages_of(dst)
    result = pair.receiver.pull_blocking(ticket, dst, 0, 12)
    assert not result.ok and "so 3 destination pages, got 2" in result.error
    assert all(torch.equal(pair.d.pages_of(dst)[g], before[g]) for g in dst)
    pair.d.free("w")
    wait_until(lambda: pair.p.released == ["w"])


def test_destination_pages_that_do_not_map_fail_the_pull_and_free_ps_pages(pair: Pair) -> None:
    """A page listed twice: the pull fails before any byte lands (a direct read maps its pages
    after asking P, while P admits it: P then hears of the failure and lets its pages go)."""
    ticket, _ = pair.publish("dup", 12)
    dst = pair.d.allocate("dup", 12)
    before = pair.d.pages_of(dst)
    twice = {g: [ids[0], *ids[:-1]] for g, ids in dst.items()}
    result = pair.receiver.pull_blocking(ticket, twice, 0, 12)
    assert not result.ok and "a page id is listed twice" in result.error
    assert all(torch.equal(pair.d.pages_of(dst)[g], before[g]) for g in dst)
    pair.d.free("dup")
    wait_until(lambda: pair.p.released == ["dup"])
    assert pair.sender.stats()["leases"] == 0
    pair.pull_ok("after")  # the link stays usable


def test_a_second_pull_of_a_finished_request_is_refused(pair: Pair) -> None:
    ticket, _ = pair.publish("twice", 8)
    dst = pair.d.allocate("twice", 8)
    assert pair.receiver.pull_blocking(ticket, dst, 0, 8).ok
    wait_until(lambda: pair.p.released == ["twice"])
    again = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert not again.ok and "ended (acked)" in again.error
    pair.d.free("twice")
    assert pair.sender.stats()["refused_pulls"] == 1


def test_a_pull_into_a_closed_receiver_raises() -> None:
    with checked_pair() as made:
        ticket, _ = made.publish("c", 8)
        made.receiver.close()
        with pytest.raises(RuntimeError, match="KVReceiver is closed"):
            made.receiver.pull_blocking(ticket, {"full": [1, 2]}, 0, 8)
        assert made.sender.cancel("c")


class Hold:
    """Stops a thread at one step (``at``, called there) until ``go_on`` is set."""

    def __init__(self) -> None:
        self.entered, self.go_on = threading.Event(), threading.Event()

    def at(self) -> None:
        self.entered.set()
        self.go_on.wait(30)


def close_while_held(hold: Hold, work: Callable[[], object], close: Callable[[], None]) -> list:
    """Run ``work`` on a thread until it reaches ``hold``, then ``close`` on another: the close
    must wait for the held work (it is still alive 2 s on), and both end once it goes on.
    Returns what ``work`` returned, in a list."""
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(work()))
    worker.start()
    assert hold.entered.wait(30)
    closer = threading.Thread(target=close)
    closer.start()
    closer.join(2.0)
    assert closer.is_alive()  # waiting for the work under way
    hold.go_on.set()
    closer.join(60)
    worker.join(60)
    assert not closer.is_alive() and not worker.is_alive() and len(results) == 1
    return results


def test_close_waits_for_a_pull_being_accepted_on_another_thread() -> None:
    """A pull accepted on one thread as close() begins on another: close sees it (it waits
    for it to be accepted, then ends it) and the pull's caller gets its result. Before, close
    could miss it and return while it ran (its pages not safe), or, as the runtime's last user,
    leave it on a stopped loop and its caller waiting for ever."""
    with checked_pair() as made:
        ticket, _ = made.publish("c", 8)
        dst = made.d.allocate("c", 8)
        hold = Hold()

        class HeldSet(set):  # accepting the pull stops just before it is counted as running
            def add(self, item: object) -> None:
                hold.at()
                super().add(item)

        made.receiver._running = HeldSet()
        pull = lambda: made.receiver.pull_blocking(ticket, dst, 0, 8)  # noqa: E731
        close_while_held(hold, pull, made.receiver.close)
        assert made.receiver.stats()["pulls_in_flight"] == 0
        made.d.free("c")
        made.sender.cancel("c")


def test_a_lease_published_as_the_sender_closes_is_released() -> None:
    """The sender's side of the same race: a publish on one thread as close() begins on another.
    Its lease is released by the close (the pages come back: checked_pair checks), or the
    publish is refused; before, a lease made after close released every lease stayed for good."""
    with checked_pair() as made:
        hold = Hold()
        real_publish = made.sender.leases.publish

        def held_publish(*args: object, **kwargs: object):  # noqa: ANN202
            hold.at()
            return real_publish(*args, **kwargs)

        made.sender.leases.publish = held_publish  # type: ignore[method-assign]
        close_while_held(hold, lambda: made.publish("c", 8), made.sender.close)
        assert made.p.released == ["c"]


@pytest.mark.parametrize("path", ["ucx", "host_shm"])
def test_prefill_worker_restart_on_the_same_port(path: str) -> None:
    """A ticket of the old instance fails as stale (its pages are gone); the new instance's
    tickets pull through a new link; a stale ticket while the current link is up leaves it up."""
    from tests.transfer.conftest import MODEL, KVSide, config, specs
    from transfer import KVReceiver, KVSender

    p, d = KVSide(specs(), seed=5), KVSide(specs(), seed=6)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config(path))
    first = KVSender(p.kv.buffers, p.specs, MODEL, config(path), p.release)
    port = first.port
    try:
        ticket = first.publish("before", p.allocate("before", 8), 8)
        assert receiver.pull_blocking(ticket, d.allocate("before", 8), 0, 8).ok
        d.free("before")
        stale = first.publish("stale", p.allocate("stale", 8), 8)
        first.close()  # releases "stale" too: its pages are gone with the old instance
        wait_until(lambda: not receiver.links)  # D saw the old link close
        second = KVSender(p.kv.buffers, p.specs, MODEL, config(path, port=port), p.release)
        try:
            result = receiver.pull_blocking(stale, d.allocate("stale", 8), 0, 8)
            assert not result.ok and "stale ticket" in result.error
            d.free("stale")
            ticket = second.publish("after", p.allocate("after", 8), 8)
            dst = d.allocate("after", 8)
            assert receiver.pull_blocking(ticket, dst, 0, 8).ok
            assert torch.equal(d.pages_of(dst)["full"], p.pages_of(ticket.page_ids)["full"])
            d.free("after")
            (link,) = receiver.links.values()
            again = receiver.pull_blocking(stale, d.allocate("stale", 8), 0, 8)
            assert not again.ok and "stale ticket" in again.error
            d.free("stale")
            assert receiver.links[(second.host, second.port)] is link and not link.closed
            wait_until(lambda: "after" in p.released)
        finally:
            second.close()
    finally:
        receiver.close()
    assert sorted(p.released) == ["after", "before", "stale"]
    p.assert_clean()
    d.assert_clean()


def test_a_pull_with_every_page_already_held_moves_nothing_and_succeeds(pair: Pair) -> None:
    ticket, _ = pair.publish("held", 8)
    result = pair.receiver.pull_blocking(ticket, {"full": []}, 2, 8)
    assert result.ok and result.bytes == 0, result.error
    wait_until(lambda: pair.p.released == ["held"])
