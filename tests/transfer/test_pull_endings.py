"""How a pull ends when it does not end well: P gives up on chunks it never started, refuses a
pull longer than D's staging, D gives up or is cancelled (while connecting, while receiving, while
P still gathers), an unexpected error, a close during a connect. In every case nothing writes the
caller's pages once the pull returned, both sides get their pages back, and the link stays up for
the other pulls."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import pytest
import torch

import transfer.links
import transfer.pull
import transfer.sender
import transfer.serve
from tests.transfer import test_transfer_failures as failures
from tests.transfer.conftest import MODEL, KVSide, config, specs
from tests.transfer.test_transfer_local import Pair, cancel_pull, wait_until
from transfer import KVReceiver, KVSender
from transfer.messages import TransferAck

pytestmark = pytest.mark.timeout(60)

pair = failures.pair  # the fixture: a Pair whose leases expire in 0.4 s
pull_next_ok = failures.pull_next_ok


class Sides:
    """P and D with configs of their own, for failures that need them to differ."""

    def __init__(self, p_cfg, d_cfg, scramble: bool = True) -> None:
        self.p, self.d = KVSide(specs(), seed=7), KVSide(specs(), seed=8)
        if scramble:  # else requests get one run of pages: chunks go straight from / into pools
            self.p.scramble_free_queue()
            self.d.scramble_free_queue()
        self.sender = KVSender(self.p.kv.buffers, self.p.specs, MODEL, p_cfg, self.p.release)
        self.receiver = KVReceiver(self.d.kv.buffers, self.d.specs, MODEL, d_cfg)
        self.held: list = []

    def hold_p_staging(self) -> None:
        """Take every staging buffer of P: its staged chunks cannot start until released."""

        async def grab():
            return [
                await self.sender.staging.acquire() for _ in range(self.sender.staging.max_buffers)
            ]

        self.held = self.sender.runtime.run(grab(), timeout=5)

    def release_p_staging(self) -> None:
        for buf in self.held:
            self.sender.runtime.loop.call_soon_threadsafe(self.sender.staging.release, buf)
        self.held = []

    def close(self) -> None:
        self.release_p_staging()
        self.receiver.close()
        self.sender.close()
        self.p.assert_clean()
        self.d.assert_clean()


def test_chunks_p_gave_up_on_fail_the_pull_and_never_pass_for_data() -> None:
    """P completes the receives of chunks it gives up on with empty messages, which D cannot tell
    from data: so P sends TransferDone only once every chunk has begun, and a pull whose chunks
    P could not start fails on D instead of completing with the bytes D had before."""
    sides = Sides(
        config(zero_copy=False, chunk_deadline_s=1.0, staging_tokens=32),  # P stages its chunk
        config(zero_copy=True, staging_tokens=32),  # D receives it straight into its pool
        scramble=False,
    )
    try:
        sides.hold_p_staging()
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        dst = sides.d.allocate("victim", 16)
        result = sides.receiver.pull_blocking(ticket, dst, 0, 16)
        assert not result.ok and "no progress" in result.error
        sides.d.free("victim")
        wait_until(lambda: "victim" in sides.p.released)
        sides.release_p_staging()
        ticket = sides.sender.publish("next", sides.p.allocate("next", 16), 16)
        dst = sides.d.allocate("next", 16)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 16).ok
        assert torch.equal(sides.d.pages_of(dst)["full"], sides.p.pages_of(ticket.page_ids)["full"])
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_refused_pull_longer_than_d_staging_keeps_the_link(monkeypatch) -> None:
    """D posts receives for as many chunks as it has staging buffers; when P refuses, the drained
    receives free those buffers and D may credit more chunks before it reads the refusal. P
    completes those late credits too, so D ends the pull at once and the link stays up."""
    real_drain = transfer.sender.drain

    async def drain_then_pause(link, pull_id, chunks) -> None:
        await real_drain(link, pull_id, chunks)
        await asyncio.sleep(0.5)  # D credits the chunks the drained receives made room for

    monkeypatch.setattr(transfer.sender, "drain", drain_then_pause)
    sides = Sides(config(zero_copy=False, lease_s=0.4), config(zero_copy=False))
    try:
        pages = sides.p.allocate("late", 32)  # 8 pages: 4 chunks, against 2 staging buffers
        ticket = sides.sender.publish("late", pages, 32)
        wait_until(lambda: "late" in sides.p.released, timeout=5.0)  # expired
        result = sides.receiver.pull_blocking(ticket, sides.d.allocate("late", 32), 0, 32)
        assert not result.ok and "(expired)" in result.error
        sides.d.free("late")
        assert sides.receiver.stats()["reconnects"] == 0
        ticket = sides.sender.publish("next", sides.p.allocate("next", 32), 32)
        dst = sides.d.allocate("next", 32)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 32).ok
        assert torch.equal(sides.d.pages_of(dst)["full"], sides.p.pages_of(ticket.page_ids)["full"])
        assert sides.receiver.stats()["reconnects"] == 0  # no link was aborted
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_cancelled_pull_returns_only_once_nothing_writes_its_pages() -> None:
    """The caller frees its pages when an awaited pull is cancelled: the pull fails (ending its
    receives) before the cancel reaches the caller, so chunks P sends later land nowhere. P
    completes the receives it never started, so another pull on the link goes on."""
    sides = Sides(
        config(zero_copy=False, staging_buffers=1), config(zero_copy=False, staging_buffers=1)
    )
    try:
        sides.hold_p_staging()
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)  # 2 chunks
        dst = sides.d.allocate("victim", 16)
        other = sides.sender.publish("other", sides.p.allocate("other", 8), 8)
        other_dst = sides.d.allocate("other", 8)
        results = {}

        def pull_other() -> None:
            time.sleep(0.1)  # after the victim took D's staging buffer
            results["other"] = sides.receiver.pull_blocking(other, other_dst, 0, 8)

        bystander = threading.Thread(target=pull_other)
        bystander.start()

        cancel_pull(sides.receiver, ticket, dst, 16, after_s=0.3)
        assert "victim" not in [s.ticket.request_id for s in sides.receiver.sessions.values()]
        for g, ids in dst.items():  # the caller reuses the pages
            sides.d.kv.buffers[g][ids] = 0
        sides.release_p_staging()  # P could send the chunks now
        wait_until(lambda: "victim" in sides.p.released)  # D's negative ack or P's failure
        bystander.join(30)
        assert results["other"].ok, results["other"].error
        assert torch.equal(
            sides.d.pages_of(other_dst)["full"], sides.p.pages_of(other.page_ids)["full"]
        )
        assert bool((sides.d.pages_of(dst)["full"] == 0).all())
        assert sides.receiver.stats()["reconnects"] == 0  # the cancel did not cost the link
        sides.d.free("victim")
        sides.d.free("other")
        wait_until(lambda: "other" in sides.p.released)
        assert sides.receiver.stats()["failures"] == 1
    finally:
        sides.close()


def test_a_pull_cancelled_while_connecting_returns_at_once(pair: Pair) -> None:
    """Before a pull has posted a receive nothing of it can write the caller's pages, so a cancel
    then reaches the caller at once; the session still ends by its own deadline."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # connections are queued, never answered
    try:
        ticket, _ = pair.publish("unreachable", 8)
        ticket = dataclasses.replace(ticket, port=silent.getsockname()[1])
        dst = pair.d.allocate("unreachable", 8)

        cancel_pull(pair.receiver, ticket, dst, 8, after_s=0.2)
        assert pair.receiver.stats()["failures"] == 0  # the session is still connecting
        wait_until(lambda: pair.receiver.stats()["failures"] == 1)  # its connect deadline
        pair.d.free("unreachable")
        wait_until(lambda: "unreachable" in pair.p.released)  # its lease expired meanwhile
    finally:
        silent.close()
    pull_next_ok(pair, "after-unreachable")


def test_an_unexpected_error_after_receives_are_posted_still_ends_them(monkeypatch) -> None:
    """A bug or a device error in the middle of a pull fails that pull like any failure: its
    receives end (D's staging buffers come back), P is told, and the next pull works."""
    sides = Sides(config(zero_copy=False), config(zero_copy=False))

    def broken(self, ready):
        raise RuntimeError("boom")

    try:
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        with monkeypatch.context() as patch:
            patch.setattr(transfer.pull.PullSession, "_pull_request", broken)
            result = sides.receiver.pull_blocking(ticket, sides.d.allocate("victim", 16), 0, 16)
        assert not result.ok and "internal error" in result.error and "boom" in result.error
        assert sides.receiver.staging.in_use == 0
        sides.d.free("victim")
        wait_until(lambda: "victim" in sides.p.released, timeout=2.0)  # the negative ack
        ticket = sides.sender.publish("next", sides.p.allocate("next", 16), 16)
        dst = sides.d.allocate("next", 16)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 16).ok
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_link_a_cancelled_pull_makes_after_close_is_not_kept(monkeypatch) -> None:
    """close() aborts the links it has; a pull cancelled while connecting may finish its
    handshake afterwards, and that link must not outlive the receiver."""
    real_connect = transfer.links.connect

    async def slow_connect(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(transfer.links, "connect", slow_connect)
    pair = Pair(config())
    try:
        ticket, _ = pair.publish("c1", 8)
        dst = pair.d.allocate("c1", 8)
        cancel_pull(pair.receiver, ticket, dst, 8, after_s=0.1)
        pair.receiver.close()
        wait_until(lambda: pair.sender.stats()["peers"] == 0)
        assert not pair.receiver.links.open
        pair.d.free("c1")
    finally:
        pair.sender.close()


def test_a_pull_d_gives_up_while_p_gathers_costs_no_link(monkeypatch) -> None:
    """D cancels while P still copies a chunk into staging (nothing of it handed to UCX yet): P
    sends that chunk empty and ends the pull without aborting the link, so another pull on it
    goes on."""
    real_gather = transfer.serve.gather_chunk
    gathers = []

    def slow_first_gather(*args):
        gathers.append(1)
        if len(gathers) == 1:
            time.sleep(0.6)  # the victim's first chunk, still being copied at the cancel
        return real_gather(*args)

    monkeypatch.setattr(transfer.serve, "gather_chunk", slow_first_gather)
    sides = Sides(config(zero_copy=False, staging_buffers=1), config(zero_copy=False))
    try:
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        dst = sides.d.allocate("victim", 16)
        other = sides.sender.publish("other", sides.p.allocate("other", 8), 8)
        other_dst = sides.d.allocate("other", 8)
        results = {}

        def pull_other() -> None:
            time.sleep(0.1)
            results["other"] = sides.receiver.pull_blocking(other, other_dst, 0, 8)

        bystander = threading.Thread(target=pull_other)
        bystander.start()
        cancel_pull(sides.receiver, ticket, dst, 16, after_s=0.3)
        bystander.join(30)
        assert results["other"].ok, results["other"].error
        assert sides.receiver.stats()["reconnects"] == 0
        sides.d.free("victim")
        sides.d.free("other")
        wait_until(lambda: {"victim", "other"} <= set(sides.p.released))
    finally:
        sides.close()


class HeldCopy:
    """A direct copy that outlived its pull, as LateCopies sees one (the Completion protocol): on
    the CPU there is no CUDA event, so the test says when it ends."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def query(self) -> bool:
        return self.ended.is_set()


def test_a_pull_cancelled_while_it_waits_for_a_late_copy_posts_nothing(monkeypatch) -> None:
    """A UCX pull into pool memory first waits for late direct copies (LateCopies). A cancel
    meanwhile finds no receive posted and hands the pages back at once, so once the wait ends the
    pull must post nothing: P's bytes must not land in pages the caller uses again."""
    cfg = config(zero_copy=True, lease_s=30.0)
    sides = Sides(cfg, cfg, scramble=False)  # one run of pages: chunks go straight into the pool
    try:
        warm = sides.sender.publish("warm", sides.p.allocate("warm", 8), 8)
        assert sides.receiver.pull_blocking(warm, sides.d.allocate("warm", 8), 0, 8).ok
        link = next(iter(sides.receiver.links.open.values()))
        real_send = link.send

        async def slow_negative_acks(msg, timeout):  # a loaded link: P hears of it late
            if isinstance(msg, TransferAck) and not msg.ok:
                await asyncio.sleep(0.2)
            await real_send(msg, timeout)

        monkeypatch.setattr(link, "send", slow_negative_acks)
        ticket = sides.sender.publish("r", sides.p.allocate("r", 8), 8)
        dst = sides.d.allocate("r", 8)
        late = HeldCopy()
        sides.receiver.late_copies.add(late)

        async def cancel_while_waiting() -> None:
            task = asyncio.ensure_future(sides.receiver.pull(ticket, dst, 0, 8))
            deadline = time.monotonic() + 10
            while sides.receiver.stats()["late_copy_waits"] == 0:
                assert time.monotonic() < deadline, "the pull never waited for the late copy"
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_while_waiting())
        for g, ids in dst.items():  # the caller uses its pages again
            sides.d.kv.buffers[g][ids] = 7
        late.ended.set()
        wait_until(lambda: "r" in sides.p.released)  # by D's negative ack
        time.sleep(0.3)  # what P might still send would have landed by now
        assert all(bool((sides.d.pages_of(dst)[g] == 7).all()) for g in dst)
        sides.d.free("r")
        sides.d.free("warm")
        wait_until(lambda: "warm" in sides.p.released)
    finally:
        sides.close()
