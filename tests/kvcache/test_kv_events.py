"""KVEventLog: off by default, consecutive events of one kind, medium and group merged, drained
once."""

from __future__ import annotations

from kvcache.kv_events import KVEvent, KVEventLog


def test_disabled_log_records_nothing() -> None:
    log = KVEventLog()
    log.record("stored", "device", "full", 1)
    assert log.drain() == []


def test_consecutive_events_merge_and_drain_empties() -> None:
    log = KVEventLog(enabled=True)
    log.record("stored", "device", "full", 1)
    log.record("stored", "device", "full", 2)
    log.record("stored", "device", "swa_8", 3)
    log.record("removed", "device", "full", 1)
    log.record("stored", "host", "full", 1)
    log.record("stored", "device", "full", 4)
    assert log.drain() == [
        KVEvent("stored", "device", "full", [1, 2]),
        KVEvent("stored", "device", "swa_8", [3]),
        KVEvent("removed", "device", "full", [1]),
        KVEvent("stored", "host", "full", [1]),
        KVEvent("stored", "device", "full", [4]),
    ]
    assert log.drain() == []
