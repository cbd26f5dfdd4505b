"""LeaseTable: one release per publish, no expiry under a pull, and an end only for the lease a
message names (never a later publish of the same request)."""

from __future__ import annotations

import pytest

from transfer.leases import Lease, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[LeaseTable, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    return LeaseTable(lambda lease: released.append(lease.request_id), clock), released, clock


def test_expiry_releases_once_and_a_later_pull_hears_why(table) -> None:
    leases, released, clock = table
    lease = leases.publish("a", {"full": [1, 2]}, 8, lease_s=5.0)
    clock.now += 4.9
    assert leases.expire_due() == 0
    clock.now += 0.2
    assert leases.expire_due() == 1 and leases.expire_due() == 0
    assert released == ["a"]
    assert leases.find("a", lease.gen) == (
        "expired",
        "the lease of request 'a' ended (expired before a pull)",
    )
    assert leases.find("b", 1)[0] == "unknown"


def test_a_lease_a_pull_holds_never_expires_and_ends_with_the_pull(table) -> None:
    leases, released, clock = table
    lease = leases.publish("a", {"full": [1]}, 4, lease_s=1.0)
    found = leases.find("a", lease.gen)
    assert found is lease and leases.begin(lease)
    assert leases.find("a", lease.gen)[0] == "busy" and not leases.begin(lease)
    clock.now += 100
    assert leases.expire_due() == 0
    assert not leases.cancel("a")  # a pull holds it: its end gives the pages back
    assert leases.end(lease, "acked") and not leases.end(lease, "again")
    assert released == ["a"]


def test_generations_keep_a_late_message_from_ending_a_later_lease(table) -> None:
    leases, released, _ = table
    old = leases.publish("r", {"full": [1]}, 4, lease_s=5.0)
    assert leases.cancel("r")
    new = leases.publish("r", {"full": [1]}, 4, lease_s=5.0)
    assert new.gen != old.gen
    assert "published again since" in leases.find("r", old.gen)[1]
    assert not leases.end_unpulled("r", old.gen, "late")  # names the old lease: nothing ends
    assert not leases.end(old, "late")
    assert leases.end_unpulled("r", new.gen, "D gave it up")
    assert released == ["r", "r"]


def test_an_unpulled_end_never_ends_a_lease_a_pull_holds(table) -> None:
    leases, released, _ = table
    lease = leases.publish("r", {"full": [1]}, 4, lease_s=5.0)
    assert leases.begin(lease)
    assert not leases.end_unpulled("r", lease.gen, "gave up")
    assert released == []
    assert leases.end(lease, "done") and released == ["r"]


def test_publish_twice_is_refused_and_release_all_ends_everything(table) -> None:
    leases, released, _ = table
    leases.publish("a", {"full": [1]}, 4, lease_s=5.0)
    with pytest.raises(ValueError, match="already published"):
        leases.publish("a", {"full": [2]}, 4, lease_s=5.0)
    held = leases.publish("b", {"full": [3]}, 4, lease_s=5.0)
    assert leases.begin(held)
    leases.release_all("closing")
    assert sorted(released) == ["a", "b"] and len(leases) == 0


def test_a_failing_release_callback_still_ends_the_lease() -> None:
    calls: list[Lease] = []

    def failing(lease: Lease) -> None:
        calls.append(lease)
        raise RuntimeError("worker gone")

    leases = LeaseTable(failing)
    leases.publish("a", {"full": [1]}, 4, lease_s=5.0)
    assert leases.cancel("a") and not leases.cancel("a")
    assert len(calls) == 1 and len(leases) == 0
