"""KVStatsInterval: once per interval, the KV stats of the interval that ends, then peaks reset."""

from __future__ import annotations

import time

import pytest

from tests.tiny_engine import PAGE, tiny_engine
from worker_common.stats_interval import KVStatsInterval


def test_each_interval_keeps_its_own_peak() -> None:
    engine = tiny_engine(32)
    interval = KVStatsInterval(0.05)
    assert engine.kv.allocate_slots("a", 10 * PAGE)
    engine.kv.free("a")
    interval.tick(engine)
    assert interval.last is None  # the first interval has not ended
    time.sleep(0.06)
    interval.tick(engine)
    assert interval.last.groups["full"].peak_used == 10 and interval.num_intervals == 1
    assert engine.kv.stats().groups["full"].peak_used == 0  # reset: nothing is held now
    assert engine.kv.allocate_slots("b", 3 * PAGE)
    time.sleep(0.06)
    interval.tick(engine)
    assert interval.last.groups["full"].peak_used == 3  # this interval's peak, not the first's
    assert engine.kv.stats().groups["full"].peak_used == 3  # still held: the peak starts there
    engine.kv.check_integrity()


def test_a_long_interval_keeps_the_peak() -> None:
    engine = tiny_engine(32)
    interval = KVStatsInterval(3600.0)
    assert engine.kv.allocate_slots("a", 5 * PAGE)
    engine.kv.free("a")
    interval.tick(engine)
    assert interval.last is None and engine.kv.stats().groups["full"].peak_used == 5


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        KVStatsInterval(0)
