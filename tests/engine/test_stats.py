"""StatsBuffer: -1 unbounded, 0 disabled, N keeps exactly the last N; drain never blocks."""

from __future__ import annotations

import threading

import pytest

from engine.stats import StatsBuffer


def test_unbounded_keeps_everything_in_order() -> None:
    buf: StatsBuffer[int] = StatsBuffer(-1)
    for i in range(5000):
        buf.append(i)
    assert buf.enabled and len(buf) == 5000
    assert buf.drain() == list(range(5000))
    assert buf.drain() == [] and len(buf) == 0


def test_zero_stores_nothing() -> None:
    buf: StatsBuffer[int] = StatsBuffer(0)
    buf.append(1)
    assert not buf.enabled and len(buf) == 0 and buf.drain() == []


def test_n_keeps_exactly_the_last_n() -> None:
    buf: StatsBuffer[int] = StatsBuffer(3)
    for i in range(10):
        buf.append(i)
    assert buf.drain() == [7, 8, 9]
    buf.append(10)
    assert buf.drain() == [10]


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])
def test_invalid_lengths(bad: object) -> None:
    with pytest.raises(
        ValueError, match="max_stats_len must be -1 \\(unbounded\\), 0 \\(disabled\\) or N >= 1"
    ):
        StatsBuffer(bad)  # type: ignore[arg-type]


def test_concurrent_drain_loses_and_duplicates_nothing() -> None:
    buf: StatsBuffer[int] = StatsBuffer(-1)
    drained: list[int] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            drained.extend(buf.drain())
        drained.extend(buf.drain())

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(20000):
        buf.append(i)
    done.set()
    thread.join()
    assert drained == list(range(20000))
