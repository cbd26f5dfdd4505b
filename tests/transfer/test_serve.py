"""The prefill side's answers to pulls: expired, unknown, stale and forged tickets are refused and
counted (``refused_pulls``) without touching the right ticket's lease; the link stays up. So
are malformed pulls (credits outside the plan) and a pull with the id of one being served."""

from __future__ import annotations

import dataclasses

import pytest

from tests.transfer.conftest import (
    Pair,
    checked_pair,
    joined_raw_peer,
    staged_pull_request,
    wait_until,
)
from transfer.messages import PullError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", ["ucx", "host_shm"])
def test_lease_expiry_frees_pages_and_a_late_pull_says_expired(path: str) -> None:
    with checked_pair(path, lease_s=1.5) as pair:
        pair.pull_ok("first")  # the link exists: the late pull finds it up
        ticket, _ = pair.publish("late", 12)
        wait_until(lambda: "late" in pair.p.released, timeout=5.0)
        assert pair.sender.stats()["expired_leases"] == 1
        dst = pair.d.allocate("late", 12)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 12)
        assert not result.ok
        assert (
            "refused the pull (expired)" in result.error and "expired before a pull" in result.error
        )
        pair.d.free("late")
        pair.pull_ok("after")
        assert pair.receiver.stats()["reconnects"] == 0  # the refusal did not cost the link


def test_a_forged_ticket_is_refused_and_the_right_one_still_pulls(pair: Pair) -> None:
    """P refuses a ticket whose pages differ from the published ones; D then sends no notice
    that could end the right ticket's lease, which pulls exactly afterwards."""
    ticket, src = pair.publish("r", 8)
    forged = dataclasses.replace(ticket, page_ids={"full": list(reversed(src["full"]))})
    dst = pair.d.allocate("r", 8)
    result = pair.receiver.pull_blocking(forged, dst, 0, 8)
    assert not result.ok and "differ from the published ones" in result.error
    assert pair.sender.stats()["refused_pulls"] == 1 and pair.sender.stats()["leases"] == 1
    result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert result.ok, result.error
    assert pair.same(src, dst)
    wait_until(lambda: pair.p.released == ["r"])
    pair.d.free("r")


def test_a_ticket_of_an_ended_lease_is_refused_once_the_request_is_published_again(
    pair: Pair,
) -> None:
    old, _ = pair.publish("r", 8)
    assert pair.sender.cancel("r")
    ticket, src = pair.publish("r", 8)  # another lease of the same request id
    dst = pair.d.allocate("r", 8)
    stale = dataclasses.replace(ticket, lease_gen=old.lease_gen)
    result = pair.receiver.pull_blocking(stale, dst, 0, 8)
    assert not result.ok and "published again since" in result.error
    result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert result.ok and pair.same(src, dst)
    wait_until(lambda: pair.p.released == ["r", "r"])  # cancelled, then pulled
    pair.d.free("r")


def test_a_ticket_never_published_is_refused(pair: Pair) -> None:
    ticket, _ = pair.publish("real", 8)
    ghost = dataclasses.replace(ticket, request_id="ghost")
    dst = pair.d.allocate("ghost", 8)
    result = pair.receiver.pull_blocking(ghost, dst, 0, 8)
    assert not result.ok and "never published here" in result.error
    pair.d.free("ghost")
    assert pair.sender.cancel("real")
    assert pair.sender.stats()["refused_pulls"] == 1


def test_a_cancel_while_a_pull_holds_the_lease_waits_for_the_pull(pair: Pair) -> None:
    """The pages of a lease a pull holds are given back by that pull's end, exactly once."""
    ticket, src = pair.publish("held", 40)
    dst = pair.d.allocate("held", 40)
    real_begin = pair.sender.leases.begin

    def begin_then_cancel(lease):  # noqa: ANN001, ANN202
        held = real_begin(lease)
        assert not pair.sender.cancel("held")  # a pull holds it: not now
        return held

    pair.sender.leases.begin = begin_then_cancel  # type: ignore[method-assign]
    result = pair.receiver.pull_blocking(ticket, dst, 0, 40)
    assert result.ok and pair.same(src, dst)
    wait_until(lambda: pair.p.released == ["held"])
    pair.d.free("held")


def test_a_pull_with_credits_outside_its_plan_is_refused_and_the_link_stays_up(
    ucx_runtime,
) -> None:
    """Credits that name no chunk of the plan (one past the data tags' range) are a malformed
    pull: refused and counted, with no answer on them (D posted no receive there), and the
    connection goes on serving."""
    with checked_pair("ucx") as pair:
        with joined_raw_peer(pair, ucx_runtime) as peer:
            for i, credits in enumerate([[7], [2**33]]):
                peer.send(staged_pull_request(pair, f"bad-{i}", 10 + i, credits))
                refusal = peer.recv()
                assert isinstance(refusal, PullError) and refusal.request_id == f"bad-{i}"
                assert "credits" in refusal.reason
            assert pair.sender.stats()["refused_pulls"] == 2
            assert pair.sender.stats()["peers"] == 1  # (the link was not closed)
            for i in range(2):
                assert pair.sender.cancel(f"bad-{i}")
        pair.pull_ok("after")


def test_a_pull_id_in_use_is_refused_under_its_own_request_and_counted(ucx_runtime) -> None:
    """A second pull on a link with the id of one being served is refused, counted, and named by
    its own request, so that D cannot take the refusal for the other pull's."""
    with checked_pair("ucx", chunk_deadline_s=1.0) as pair:
        with joined_raw_peer(pair, ucx_runtime) as peer:
            peer.send(staged_pull_request(pair, "first", 5, []))  # (no credits: P waits for them)
            wait_until(lambda: pair.sender.stats()["pulls_in_flight"] == 1)
            peer.send(staged_pull_request(pair, "second", 5, []))
            refusal = peer.recv()
            assert isinstance(refusal, PullError) and refusal.pull_id == 5
            assert refusal.request_id == "second" and "pull id in use" in refusal.reason
            assert pair.sender.stats()["refused_pulls"] == 1
            assert pair.sender.cancel("second")
        wait_until(lambda: "first" in pair.p.released)  # (its credits never came: deadline)
        pair.pull_ok("after")
