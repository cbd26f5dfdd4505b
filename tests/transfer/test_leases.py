"""Leases: the release callback runs exactly once per publish, whatever ends the lease; a lease
being served never expires. Time comes from an explicit clock."""

from __future__ import annotations

import pytest

from transfer.leases import LeaseState, LeaseTable
from transfer.read_ends import ReadEnds
from transfer.stats import StatsBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[LeaseTable, Clock, list[str]]:
    clock, released = Clock(), []
    return LeaseTable(lambda lease: released.append(lease.request_id), clock=clock), clock, released


def test_expiry_releases_once_and_remembers_why(table) -> None:
    leases, clock, released = table
    leases.publish("a", {"full": [1, 2]}, 7, lease_s=5)
    clock.now += 4.9
    assert leases.expire_due() == []
    clock.now += 0.2
    assert leases.expire_due() == ["a"] and released == ["a"]
    assert leases.expire_due() == [] and not leases.release("a", "acked") and released == ["a"]
    assert leases.why_missing("a") == ("expired", "the lease of request 'a' expired before a pull")


def test_a_lease_being_served_does_not_expire_and_only_force_releases_it(table) -> None:
    leases, clock, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1)
    assert leases.begin_serving("a").state is LeaseState.SERVING
    clock.now += 100
    assert leases.expire_due() == [] and not leases.release("a", "acked") and not leases.cancel("a")
    assert leases.get("a").cancel_requested
    assert leases.release("a", "failed: peer died", force=True) and released == ["a"]
    assert leases.why_missing("a") == (
        "unknown",
        "request 'a' was already released (failed: peer died)",
    )


def test_serving_a_lease_that_was_published_again_is_refused(table) -> None:
    leases, _clock, _released = table
    old = leases.publish("a", {"full": [1]}, 3, lease_s=5)
    assert leases.release("a", "cancelled")
    leases.publish("a", {"full": [1]}, 3, lease_s=5)  # the same id, other bytes
    with pytest.raises(ValueError, match="published again"):
        leases.begin_serving("a", old)
    assert leases.get("a").state is LeaseState.PUBLISHED


def test_renewal_and_the_ack_deadline(table) -> None:
    leases, clock, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1)
    leases.begin_serving("a")
    leases.renew("a", lease_s=10)
    leases.await_ack("a", ack_deadline_s=2)
    clock.now += 1.5
    assert leases.expire_due() == []
    clock.now += 1
    assert leases.expire_due() == ["a"]
    assert leases.why_missing("a")[1].endswith("expired waiting for the ack")


def test_a_cancel_while_serving_ends_the_lease_with_the_pull(table) -> None:
    """cancel() cannot free pages a pull reads; the pull's end then does, not the ack deadline. A
    cancel once the pull has sent everything ends the lease at once."""
    leases, _, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1)
    leases.begin_serving("a")
    assert not leases.cancel("a") and released == []
    assert not leases.await_ack("a", ack_deadline_s=2)  # the caller releases it now
    assert leases.get("a").state is LeaseState.SERVING
    leases.publish("b", {"full": [2]}, 3, lease_s=1)
    leases.begin_serving("b")
    assert leases.await_ack("b", ack_deadline_s=2)
    assert leases.cancel("b") and released == ["b"]


def test_an_ack_ends_only_the_lease_of_its_generation_in_a_state_it_may_end(table) -> None:
    leases, _, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1, gen=7)
    assert not leases.end_on_ack("a", 6, False, "an older lease's ack")
    assert not leases.end_on_ack("a", 7, True, "acked before any pull")  # positive: no pull had it
    leases.begin_serving("a")
    assert not leases.end_on_ack("a", 7, False, "gave up")  # the serving pull ends it
    assert leases.await_ack("a", ack_deadline_s=2)
    assert leases.end_on_ack("a", 7, True, "acked") and released == ["a"]
    leases.publish("b", {"full": [2]}, 3, lease_s=1, gen=8)
    assert leases.end_on_ack("b", 8, False, "D gave up before asking") and released == ["a", "b"]


def test_cancel_publish_twice_and_unknown(table) -> None:
    leases, _, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1)
    with pytest.raises(ValueError, match="already published"):
        leases.publish("a", {"full": [1]}, 3, lease_s=1)
    assert leases.cancel("a") and released == ["a"]
    assert leases.why_missing("zzz") == ("unknown", "request 'zzz' was never published here")
    with pytest.raises(ValueError, match="not waiting for a pull"):
        leases.publish("b", {"full": [2]}, 3, lease_s=1)
        leases.begin_serving("b")
        leases.begin_serving("b")


def test_a_failing_release_callback_still_ends_the_lease() -> None:
    def explode(_: object) -> None:
        raise RuntimeError("boom")

    leases = LeaseTable(explode)
    leases.publish("a", {"full": [1]}, 3, lease_s=1)
    assert leases.release("a", "acked") and len(leases) == 0


def racing_end(leases: LeaseTable, meanwhile) -> None:
    """Run ``meanwhile`` once, right before the table's first check-and-end: the widest window a
    caller that checks first and ends after could have."""
    real, ran = leases._end, []

    def end(*args):
        if not ran:
            ran.append(True)
            meanwhile()
        return real(*args)

    leases._end = end


def test_a_late_end_of_a_direct_read_never_ends_a_later_lease_of_the_request(table) -> None:
    leases, _, released = table
    ends = ReadEnds(leases, StatsBook())
    leases.publish("a", {"full": [1]}, 3, lease_s=5, slot=0, gen=1)
    # The worker cancels lease 1 and publishes the request again while P's loop handles the end
    # of a direct read of lease 1 (a ReadDone, or a done-board record).
    racing_end(
        leases,
        lambda: (
            leases.cancel("a"),
            leases.publish("a", {"full": [2]}, 3, lease_s=5, slot=0, gen=2),
        ),
    )
    ends.finished("a", 1, True, "", 4, 10, "local")
    assert leases.get("a").gen == 2 and released == ["a"]  # only lease 1's cancel
    ends.finished("a", 2, True, "", 4, 10, "local")
    assert leases.get("a") is None and released == ["a", "a"]  # lease 2, by its own end


def test_the_reaper_ends_only_the_lease_it_found_due(table) -> None:
    leases, clock, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=1, gen=1)
    clock.now += 2  # due
    racing_end(
        leases,
        lambda: (
            leases.cancel("a"),
            leases.publish("a", {"full": [2]}, 3, lease_s=10, gen=2),
        ),
    )
    assert leases.expire_due() == []
    assert leases.get("a").gen == 2 and released == ["a"]  # the cancel's; the new one lives


def test_a_cancel_racing_a_pull_start_still_ends_the_lease_with_that_pull(table) -> None:
    leases, _, released = table
    leases.publish("a", {"full": [1]}, 3, lease_s=5)
    racing_end(leases, lambda: leases.begin_serving("a"))  # the pull starts mid-cancel
    assert not leases.cancel("a")  # a pull reads the pages: its end gives them back
    assert not leases.await_ack("a", ack_deadline_s=2)  # ... at once, not at the ack
    assert leases.release("a", "cancelled", force=True) and released == ["a"]
