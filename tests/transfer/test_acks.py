"""How P ends a lease on D's acks and on a cancel: an ack ends only the lease its generation names
(never a later publish of the request), even once P forgot the pull; a cancel while a pull reads
the pages ends the lease with that pull, not at the ack deadline. D's caller has a checked pull's
result before its ack goes, and an ack that is lost only leaves P's pages to the ack deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

import transfer.sender
from tests.transfer.conftest import config
from tests.transfer.test_pull_endings import Sides
from tests.transfer.test_transfer_failures import pull_next_ok
from tests.transfer.test_transfer_local import checked_pair, wait_until
from transfer.control import ChannelClosed
from transfer.messages import TransferAck

pytestmark = pytest.mark.timeout(60)


def test_an_ack_releases_only_the_lease_its_own_pull_served(monkeypatch) -> None:
    """P matches an ack by its pull, not by request id alone: an ack of a pull of an earlier lease
    of the same request id (released, then published again) and an ack of a pull P never served
    end nothing, and the new ticket's pull still gets its pages."""
    with checked_pair(config(lease_s=30.0)) as pair:
        pull_next_ok(pair, "first")  # opens the link
        link = next(iter(pair.receiver.links.open.values()))
        acks: list[TransferAck] = []
        real_send = link.send

        async def recording(msg, timeout):
            if isinstance(msg, TransferAck):
                acks.append(msg)
            await real_send(msg, timeout)

        monkeypatch.setattr(link, "send", recording)
        pull_next_ok(pair, "r")  # its ack ends its lease
        assert [a.request_id for a in acks] == ["r"] and acks[0].ok
        ticket, src = pair.publish("r", 8)  # the same request id, a new lease
        for stale in (
            acks[0],
            TransferAck("r", acks[0].pull_id + 1, False, "not a pull of P's", ticket.lease_gen + 1),
        ):
            pair.receiver.runtime.loop.call_soon_threadsafe(link.post, stale)
        pull_next_ok(pair, "later")  # P handled the two acks before this pull's request
        assert pair.p.released.count("r") == 1 and pair.sender.leases.get("r") is not None
        dst = pair.d.allocate("r", 8)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert result.ok, result.error
        assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])
        wait_until(lambda: pair.p.released.count("r") == 2)
        pair.d.free("r")


@pytest.mark.parametrize("ack", ["late", "lost"])
def test_the_caller_has_its_result_before_the_ack_goes(monkeypatch, ack: str) -> None:
    """The ack only frees P's pages: a late one does not hold the caller's result back, and a lost
    one leaves the pull a success, P's pages freed when the ack deadline expires the lease."""
    with checked_pair(config(ack_deadline_s=1.0)) as pair:
        pull_next_ok(pair, "first")  # opens the link
        link = next(iter(pair.receiver.links.open.values()))
        real_send = link.send

        async def held_back(msg, timeout):
            if isinstance(msg, TransferAck):
                if ack == "lost":
                    raise ChannelClosed("the ack was lost")
                await asyncio.sleep(0.5)
            await real_send(msg, timeout)

        monkeypatch.setattr(link, "send", held_back)
        ticket, src = pair.publish("r", 8)
        dst = pair.d.allocate("r", 8)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert result.ok, result.error
        assert "r" not in pair.p.released  # (P still waits for the ack)
        assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])
        wait_until(lambda: "r" in pair.p.released)
        expired = pair.sender.stats()["expired_leases"]
        assert expired == (1 if ack == "lost" else 0)
        pair.d.free("r")


def test_an_ack_after_its_pull_was_forgotten_still_ends_its_lease(monkeypatch) -> None:
    """P remembers ended pulls only so long (ENDED_PULLS_KEPT, all links together); their acks,
    which mostly come after the session ended, still end the lease their generation names at once,
    not when the ack deadline expires it."""
    monkeypatch.setattr(transfer.sender, "ENDED_PULLS_KEPT", 0)
    with checked_pair(config(ack_deadline_s=30.0)) as pair:
        pull_next_ok(pair, "r")  # waits until P released the pages
        assert pair.sender.stats()["expired_leases"] == 0


def test_a_cancel_while_a_pull_reads_ends_the_lease_with_that_pull(monkeypatch) -> None:
    """P's cancel cannot free pages a pull is reading; the pull's end does, even when D's ack
    never comes (else the pages stayed pinned until the ack deadline)."""
    cfg = config(ack_deadline_s=30.0, lease_s=30.0)
    # (P stages its chunks, so holding its staging buffers holds the pull: no piece lists)
    sides = Sides(dataclasses.replace(cfg, host_iov=False), cfg)
    try:
        warm = sides.sender.publish("warm", sides.p.allocate("warm", 8), 8)
        assert sides.receiver.pull_blocking(warm, sides.d.allocate("warm", 8), 0, 8).ok
        link = next(iter(sides.receiver.links.open.values()))
        real_send = link.send

        async def no_positive_acks(msg, timeout):  # lost on the way
            if not (isinstance(msg, TransferAck) and msg.ok):
                await real_send(msg, timeout)

        monkeypatch.setattr(link, "send", no_positive_acks)
        sides.hold_p_staging()  # P cannot start the pull's chunks yet
        ticket = sides.sender.publish("r", sides.p.allocate("r", 8), 8)
        dst = sides.d.allocate("r", 8)
        results = []
        puller = threading.Thread(
            target=lambda: results.append(sides.receiver.pull_blocking(ticket, dst, 0, 8))
        )
        puller.start()
        wait_until(lambda: sides.sender.leases.get("r").state.value == "serving")
        assert not sides.sender.cancel("r")  # a pull reads the pages
        sides.release_p_staging()
        puller.join(30)
        assert results and results[0].ok, results
        assert torch.equal(sides.d.pages_of(dst)["full"], sides.p.pages_of(ticket.page_ids)["full"])
        wait_until(lambda: "r" in sides.p.released, timeout=5.0)
        assert sides.sender.stats()["expired_leases"] == 0
        sides.d.free("r")
        sides.d.free("warm")
        wait_until(lambda: "warm" in sides.p.released)
    finally:
        sides.close()
