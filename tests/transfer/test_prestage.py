"""The prefill side gathers a published request's first chunk at publish time (transfer/prestage.py):
sent when it is the pull's chunk 0, gathered again when it is not, and its buffer always back."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.transfer.conftest import MODEL
from tests.transfer.conftest import config as base_config
from tests.transfer.test_transfer_local import Pair, checked_pair, wait_until
from transfer import KVReceiver
from transfer.mapper import Fragment
from transfer.plan import Chunk
from transfer.prestage import source_ranges

pytestmark = pytest.mark.timeout(60)


def config(**overrides: object):
    """Prestaging belongs to the staged path. Host pools send scattered pages as piece lists
    instead (``host_iov``), so these tests turn that off and stage as GPU pools do."""
    return base_config(host_iov=False, **overrides)


def first_pull(made: Pair) -> None:
    """A UCX pull that makes the link one P prestages for."""
    ticket, _ = made.publish("warm", 8)
    dst = made.d.allocate("warm", 8)
    assert made.receiver.pull_blocking(ticket, dst, 0, 8).ok
    wait_until(lambda: made.p.released == ["warm"])
    made.d.free("warm")
    assert made.sender.stats()["prestaged_chunks"] == 0  # no UCX puller was known yet


def held(made: Pair) -> int:
    return made.sender.runtime.run(_held(made), timeout=5)


async def _held(made: Pair) -> int:
    return len(made.sender.prestage)


def test_a_prestaged_first_chunk_is_sent_and_arrives_byte_exact() -> None:
    with checked_pair(config(staging_buffers=4)) as made:  # 2 pages a chunk, 2 may be prestaged
        first_pull(made)
        tickets = {rid: made.publish(rid, 22) for rid in ("a", "b", "c")}  # 6 pages: 3 chunks
        wait_until(lambda: held(made) == 2)  # "c" found no buffer to spare: gathered at its pull
        for rid, (ticket, src) in tickets.items():
            dst = made.d.allocate(rid, 22)
            result = made.receiver.pull_blocking(ticket, dst, 0, 22)
            assert result.ok, result.error
            assert torch.equal(made.d.pages_of(dst)["full"], made.p.pages_of(src)["full"])
            made.d.free(rid)
        assert made.sender.stats()["prestaged_chunks"] == 2
        wait_until(lambda: made.sender.staging.in_use == 0)


def test_a_pull_that_skips_pages_gathers_its_own_first_chunk() -> None:
    with checked_pair(config(staging_buffers=2)) as made:
        first_pull(made)
        ticket, src = made.publish("s", 22)
        wait_until(lambda: held(made) == 1)
        with made.d.lock:
            assert made.d.kv.allocate_slots("s", 22)
            all_dst = made.d.kv.page_ids("s")
        dst = {g: ids[1:] for g, ids in all_dst.items()}  # D has the first page already
        result = made.receiver.pull_blocking(ticket, dst, 1, 22)
        assert result.ok, result.error
        sent, got = made.p.pages_of(src)["full"], made.d.pages_of(all_dst)["full"]
        assert torch.equal(got[1:], sent[1:])
        assert made.sender.stats()["prestaged_chunks"] == 0  # its chunk 0 starts a page later
        assert held(made) == 0
        wait_until(lambda: made.sender.staging.in_use == 0)
        made.d.free("s")


@pytest.mark.parametrize("how", ["cancel", "expiry"])
def test_a_prestaged_request_that_is_never_pulled_gives_its_buffer_back(how: str) -> None:
    with checked_pair(config(staging_buffers=2, lease_s=0.5)) as made:
        first_pull(made)
        made.publish("never", 22)
        wait_until(lambda: held(made) == 1)
        if how == "cancel":
            assert made.sender.cancel("never")
        wait_until(lambda: made.p.released == ["warm", "never"])
        wait_until(lambda: held(made) == 0 and made.sender.staging.in_use == 0)


def test_no_prestaging_when_turned_off() -> None:
    with checked_pair(config(staging_buffers=2, prestage=False)) as made:
        first_pull(made)
        ticket, src = made.publish("off", 22)
        dst = made.d.allocate("off", 22)
        assert made.receiver.pull_blocking(ticket, dst, 0, 22).ok
        assert held(made) == 0 and made.sender.stats()["prestaged_chunks"] == 0
        made.d.free("off")


def test_a_direct_link_costs_no_prestaging() -> None:
    with checked_pair(config(staging_buffers=2, direct_copy=True)) as made:
        for rid in ("d1", "d2"):  # both read by D itself: P never sees a PullRequest
            ticket, _ = made.publish(rid, 22)
            dst = made.d.allocate(rid, 22)
            result = made.receiver.pull_blocking(ticket, dst, 0, 22)
            assert result.ok and result.stats.path == "local", result
            assert held(made) == 0
            made.d.free(rid)
        assert made.sender.staging.in_use == 0


def test_source_ranges_merge_adjacent_runs_only() -> None:
    page = 4096
    frags = [
        Fragment("full", "full", 3 * page, 9 * page, page),
        Fragment("full", "full", 4 * page, 2 * page, page),  # follows on P, not on D
        Fragment("full", "full", 8 * page, 3 * page, 2 * page),
        Fragment("other", "other", 10 * page, 0, page),
    ]
    assert source_ranges(Chunk(0, tuple(frags))) == (
        ("full", 3 * page, 2 * page),
        ("full", 8 * page, 2 * page),
        ("other", 10 * page, page),
    )


def test_a_request_published_again_never_gets_the_old_gather() -> None:
    """A cancelled request's pages may be rewritten and published again under the same id while
    the cancelling thread is still inside the release callback: the new pull must send the new
    bytes, not a buffer gathered for the old lease."""
    in_callback, go_on = threading.Event(), threading.Event()
    with checked_pair(config(staging_buffers=2)) as made:
        release = made.p.release

        def slow_release(rid: str) -> None:
            if rid == "r" and not in_callback.is_set():
                in_callback.set()
                go_on.wait(10)  # the canceller is descheduled here; the worker keeps the pages
                return
            release(rid)

        made.sender._release = slow_release
        first_pull(made)
        ticket, src = made.publish("r", 22)
        wait_until(lambda: held(made) == 1)
        canceller = threading.Thread(target=made.sender.cancel, args=("r",))
        canceller.start()
        try:
            assert in_callback.wait(5)
            pool = made.p.kv.buffers["full"]
            pool[src["full"]] = torch.randn(
                (len(src["full"]), *pool.shape[1:]), generator=made.p.gen
            ).to(pool.dtype)
            again = made.sender.publish("r", src, 22)
            dst = made.d.allocate("r", 22)
            result = made.receiver.pull_blocking(again, dst, 0, 22)
            assert result.ok, result.error
            assert torch.equal(made.d.pages_of(dst)["full"], made.p.pages_of(src)["full"])
        finally:
            go_on.set()
            canceller.join(10)
        wait_until(lambda: made.p.released == ["warm", "r"])
        made.d.free("r")
        wait_until(lambda: made.sender.staging.in_use == 0)


def test_a_pull_that_cannot_credit_chunk_0_at_once_gives_the_buffer_back() -> None:
    """A session whose chunk 0 is not credited yet would keep the prestaged buffer pinned while
    D waits for its own staging: it gives it back (and the buffers out for prestaging never pass
    half of P's)."""
    with checked_pair(config(staging_buffers=2)) as made:
        first_pull(made)
        ticket, src = made.publish("a", 22)
        wait_until(lambda: held(made) == 1)
        d_buffers = made.receiver.runtime.run(_take_all(made.receiver.staging), timeout=5)
        dst = made.d.allocate("a", 22)
        result: list = []
        puller = threading.Thread(
            target=lambda: result.append(made.receiver.pull_blocking(ticket, dst, 0, 22))
        )
        puller.start()
        # (P's session is waiting for chunk 0's credit, holding no staging buffer)
        wait_until(lambda: held(made) == 0 and made.sender.staging.in_use == 0)
        made.publish("c", 22)  # a buffer is free for another request meanwhile
        wait_until(lambda: held(made) == 1)
        assert made.sender.prestage.out <= made.sender.prestage.limit
        made.receiver.runtime.run(_give_all(made.receiver.staging, d_buffers), timeout=5)
        puller.join(30)
        assert result and result[0].ok, result
        assert torch.equal(made.d.pages_of(dst)["full"], made.p.pages_of(src)["full"])
        assert made.sender.stats()["prestaged_chunks"] == 0
        assert made.sender.cancel("c")
        made.d.free("a")
        wait_until(lambda: made.sender.staging.in_use == 0)


async def _take_all(staging) -> list:
    taken = []
    while (buf := staging.try_acquire()) is not None:
        taken.append(buf)
    return taken


async def _give_all(staging, buffers: list) -> None:
    for buf in buffers:
        staging.release(buf)


def test_the_chunk_size_agreed_with_a_smaller_decode_side_is_the_one_prestaged() -> None:
    p_cfg, d_cfg = config(staging_tokens=16, staging_buffers=2), config(staging_tokens=8)
    made = Pair(p_cfg)
    made.receiver.close()
    made.receiver = KVReceiver(made.d.kv.buffers, made.d.specs, MODEL, d_cfg)
    try:
        first_pull(made)
        ticket, src = made.publish("small", 22)  # 6 pages: chunks of 2 pages (D's size)
        wait_until(lambda: held(made) == 1)
        dst = made.d.allocate("small", 22)
        result = made.receiver.pull_blocking(ticket, dst, 0, 22)
        assert result.ok and result.stats.chunks == 3, result
        assert torch.equal(made.d.pages_of(dst)["full"], made.p.pages_of(src)["full"])
        assert made.sender.stats()["prestaged_chunks"] == 1
        made.d.free("small")
    finally:
        made.close()
    made.p.assert_clean()
    made.d.assert_clean()
