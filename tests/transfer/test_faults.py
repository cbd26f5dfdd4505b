"""Fault injection: a seeded, reproducible choice of pulls that both ends agree on, and each point
failing the real transport there: the pull fails with the injection named, both sides get their
pages back, the injection is counted, and the next pull goes through."""

from __future__ import annotations

import pytest

from tests.transfer.conftest import IN_PLACE, checked_pair, wait_until
from transfer import FaultInjection
from transfer.config import FAULT_POINTS
from transfer.faults import FaultInjector
from transfer.paths import staging

pytestmark = pytest.mark.timeout(60)


def test_the_choice_is_seeded_and_near_the_fraction() -> None:
    """transfer.fault_injection.seed picks which pulls fail: the same on both ends and in a
    rerun, another set with another seed; transfer.fault_injection.fraction how many."""
    ids = [f"req-{i}" for i in range(2000)]
    a = FaultInjector(FaultInjection(fraction=0.1, seed=7))
    b = FaultInjector(FaultInjection(fraction=0.1, seed=7))
    points = [a.point(r) for r in ids]
    assert points == [b.point(r) for r in ids]  # both ends of every pull agree
    hit = [p for p in points if p is not None]
    assert 140 <= len(hit) <= 260  # 10% of 2000, within noise
    assert set(hit) == set(FAULT_POINTS)
    other = FaultInjector(FaultInjection(fraction=0.1, seed=8))
    assert [other.point(r) for r in ids] != points
    assert all(FaultInjector(FaultInjection()).point(r) is None for r in ids)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        FaultInjection(fraction=1.5)
    with pytest.raises(ValueError, match="points"):
        FaultInjection(fraction=0.1, points=("somewhere",))


def _ids(injector: FaultInjector, point: str) -> tuple[str, str, str]:
    """A request id the injector fails at ``point``, and two it leaves alone."""
    chosen = next(f"f{i}" for i in range(1000) if injector.point(f"f{i}") == point)
    clean = [f"c{i}" for i in range(1000) if injector.point(f"c{i}") is None]
    return chosen, clean[0], clean[1]


@pytest.mark.parametrize("point", FAULT_POINTS)
@pytest.mark.parametrize("path", ["ucx", "host_shm", IN_PLACE])
def test_each_point_fails_the_pull_and_every_page_comes_back(
    path: str, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == IN_PLACE:  # UCX chunks as runs of pages, received and sent in place
        monkeypatch.setattr(staging, "RUN_PAGE_BYTES", 0)
        path = "ucx"
    faults = FaultInjection(fraction=0.5, points=(point,), seed=3)
    with checked_pair(path, fault_injection=faults, lease_s=1.5) as pair:
        chosen, clean, after = _ids(FaultInjector(faults), point)
        pair.pull_ok(clean)  # (the link exists, so "connect" fails a pull, not a handshake)
        result, _, _ = pair.pull(chosen, 40)  # 10 pages: 5 chunks over UCX
        assert not result.ok and f"injected fault at {point}" in result.error
        pair.d.free(chosen)
        # P gets its pages back: from D's notice, its own failure, or (connect) lease expiry.
        wait_until(lambda: chosen in pair.p.released, timeout=5.0)
        side = pair.sender if point == "before_data" else pair.receiver
        assert side.stats()["injected_faults"] == 1
        if point == "connect":
            assert pair.sender.stats()["expired_leases"] == 1
        # (no path was taken before a failed connect: /perf_metrics says none, not "ucx")
        assert result.stats.path == (None if point == "connect" else path)
        pair.pull_ok(after)


@pytest.mark.parametrize("path", ["ucx", "host_shm"])
def test_mid_data_fails_a_pull_with_nothing_to_move(path: str) -> None:
    """A pull whose pages D holds already (every page skipped) fails at mid_data too when chosen,
    on every path: the choice of pulls is the fraction's, whatever they move."""
    faults = FaultInjection(fraction=0.5, points=("mid_data",), seed=3)
    with checked_pair(path, fault_injection=faults) as pair:
        chosen, clean, _ = _ids(FaultInjector(faults), "mid_data")
        for rid, ok in [(chosen, False), (clean, True)]:
            ticket, _ = pair.publish(rid, 8)
            pair.d.allocate(rid, 8)
            result = pair.receiver.pull_blocking(ticket, {"full": []}, 2, 8)
            assert result.ok is ok
            pair.d.free(rid)
            wait_until(lambda rid=rid: rid in pair.p.released, timeout=5.0)
        assert pair.receiver.stats()["injected_faults"] == 1
