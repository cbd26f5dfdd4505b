"""PerfMetricsCollector as a plain class: the join, once-only reporting, bounds, and concurrency."""

from __future__ import annotations

import threading

import pytest

from cluster.collector import PerfMetricsCollector, expected_roles_for
from cluster.messages import CollectorStats, RequestClosed, RequestTimings, Role
from tests.cluster.conftest import decode_timings, prefill_timings

DISAGGREGATED = expected_roles_for(aggregated=False)
AGGREGATED = expected_roles_for(aggregated=True)


def test_expected_roles() -> None:
    assert DISAGGREGATED == {Role.PREFILL, Role.DECODE}
    assert AGGREGATED == {Role.DECODE}


def test_joins_both_roles_into_one_record() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    prefill, decode = prefill_timings("r1"), decode_timings("r1")
    collector.ingest([decode])
    collector.ingest([prefill])
    [record] = collector.drain()
    assert (record.request_id, record.prefill, record.decode) == ("r1", prefill, decode)
    assert collector.drain() == []
    assert collector.stats() == CollectorStats(ingested=2, joined=1)


def test_join_spans_drains() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    collector.ingest([prefill_timings("r1"), prefill_timings("r2")])
    assert collector.drain() == []
    assert collector.stats().pending == 2
    collector.ingest([decode_timings("r2")])
    assert [r.request_id for r in collector.drain()] == ["r2"]
    assert collector.stats().pending == 1


def test_aggregated_mode_needs_only_the_decode_role() -> None:
    collector = PerfMetricsCollector(AGGREGATED)
    decode = decode_timings("r1")
    collector.ingest([decode])
    [record] = collector.drain()
    assert (record.prefill, record.decode) == (None, decode)


def test_last_report_completes_early_and_later_reports_are_late() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    local = decode_timings("r1", last_report=True)  # D prefilled locally
    ended = prefill_timings("r2", last_report=True, finish_reason="stop")  # at its first token
    collector.ingest([local, ended])
    records = {r.request_id: r for r in collector.drain()}
    assert (records["r1"].prefill, records["r1"].decode) == (None, local)
    assert (records["r2"].prefill, records["r2"].decode) == (ended, None)
    collector.ingest([prefill_timings("r1")])
    assert collector.drain() == []
    assert collector.stats() == CollectorStats(ingested=3, joined=2, late=1)


def failed(request_id: str, attempt: int, worker_id: str = "p0") -> RequestTimings:
    """A prefill attempt's report that failed (not last: the router may try again)."""
    return prefill_timings(
        request_id, worker_id, finish_reason="error", prefill_attempt=attempt, output_tokens=0
    )


@pytest.mark.parametrize("order", ["failed first", "failed last"])
def test_a_retried_prefill_joins_the_attempt_that_served_it(order: str) -> None:
    """P0 failed, the router retried on P1, whose KV D took: the record is P1's and D's, whatever
    order the reports come in; P0's report is left out (superseded), never the record's outcome."""
    collector = PerfMetricsCollector(DISAGGREGATED)
    served = prefill_timings("r1", "p1", prefill_attempt=1)
    decode = decode_timings("r1", prefill_attempt=1)
    if order == "failed first":
        collector.ingest([failed("r1", 0)])
        collector.ingest([decode])
        assert collector.drain() == []  # D's attempt is not in yet
        collector.ingest([served])
    else:
        collector.ingest([served, decode])
    [record] = collector.drain()
    assert (record.prefill, record.decode, record.failed_prefill_attempts) == (served, decode, 1)
    assert record.finish_reason == "length" and record.to_dict()["failed_prefill_attempts"] == 1
    if order == "failed last":
        collector.ingest([failed("r1", 0)])
        assert collector.drain() == []
    stats = collector.stats()
    assert (stats.joined, stats.superseded, stats.late, stats.pending) == (1, 1, 0, 0)


def test_a_local_fallback_after_a_failed_prefill_is_the_decode_workers_record() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    local = decode_timings("r1", last_report=True, prefill_attempt=1, prefill_start=101.0)
    collector.ingest([failed("r1", 0), local])
    [record] = collector.drain()
    assert (record.prefill, record.decode, record.failed_prefill_attempts) == (None, local, 1)
    assert collector.stats().superseded == 1


@pytest.mark.parametrize("close_first", [True, False])
def test_a_request_the_router_closed_ends_with_its_last_attempt(close_first: bool) -> None:
    """No decode worker took it (no fallback, or its client left): the router's close completes
    the record with the last attempt's report, before or after that report arrives."""
    collector = PerfMetricsCollector(DISAGGREGATED)
    last = failed("r1", 1, "p1")
    collector.ingest([failed("r1", 0)])
    if close_first:
        collector.close(RequestClosed("r1", last_attempt=1, reason="error"))
        assert collector.drain() == []  # attempt 1's report is still on its way
        collector.ingest([last])
    else:
        collector.ingest([last])
        assert collector.drain() == []  # it may yet be retried
        collector.close(RequestClosed("r1", last_attempt=1, reason="error"))
    [record] = collector.drain()
    assert (record.prefill, record.decode, record.failed_prefill_attempts) == (last, None, 1)
    assert record.finish_reason == "error"
    stats = collector.stats()
    assert (stats.joined, stats.superseded, stats.pending) == (1, 1, 0)


def test_a_close_without_reports_keeps_nothing_pending() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    collector.close(RequestClosed("gone", last_attempt=0))  # its worker never saw it
    assert collector.drain() == [] and collector.stats().pending == 0
    with pytest.raises(ValueError, match="no attempt"):
        RequestClosed("none", last_attempt=-1)


def test_a_close_after_a_worker_that_died_ends_with_the_last_report_that_comes() -> None:
    """Attempt 0 failed (reported), attempt 1's worker died (no report ever): the router closes
    with the last attempt that reports, so the record does not wait for ever."""
    collector = PerfMetricsCollector(DISAGGREGATED)
    first = failed("r1", 0)
    collector.ingest([first])
    collector.close(RequestClosed("r1", last_attempt=0, reason="error"))
    [record] = collector.drain()
    assert (record.prefill, record.failed_prefill_attempts) == (first, 0)
    assert collector.stats().pending == 0


def test_a_close_after_a_decode_worker_died_mid_stream_counts_its_tokens() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    collector.ingest([prefill_timings("r1")])
    collector.close(RequestClosed("r1", last_attempt=0, reason="error", decoded_tokens=3))
    [record] = collector.drain()
    assert (record.output_tokens, record.finish_reason) == (4, "error")


def test_a_close_at_the_first_token_gives_the_record_its_end() -> None:
    """The client left as P handed the request off: P's report has no finish of its own."""
    collector = PerfMetricsCollector(DISAGGREGATED)
    handed = prefill_timings("r1")
    collector.ingest([handed])
    collector.close(RequestClosed("r1", last_attempt=0))
    [record] = collector.drain()
    assert (record.prefill, record.finish_reason) == (handed, "abort")


def test_each_request_is_reported_once() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED)
    first = prefill_timings("r1")
    collector.ingest([first, prefill_timings("r1", worker_id="p1")])  # a retried prefill
    collector.ingest([decode_timings("r1")])
    [record] = collector.drain()
    assert record.prefill is first
    collector.ingest([decode_timings("r1"), prefill_timings("r1")])
    assert collector.drain() == []
    stats = collector.stats()
    assert (stats.joined, stats.duplicates, stats.late, stats.pending) == (1, 1, 2, 0)


def test_worker_buffer_keeps_the_newest_and_counts_drops() -> None:
    collector = PerfMetricsCollector(AGGREGATED, max_records_per_worker=3)
    collector.ingest([decode_timings(f"r{i}", worker_id="d0") for i in range(5)])
    collector.ingest([decode_timings("x0", worker_id="d1")])
    assert sorted(r.request_id for r in collector.drain()) == ["r2", "r3", "r4", "x0"]
    stats = collector.stats()
    assert (stats.ingested, stats.dropped, stats.total_dropped) == (6, {"d0": 2}, 2)


def test_zero_disables_and_minus_one_is_unbounded() -> None:
    disabled = PerfMetricsCollector(AGGREGATED, max_records_per_worker=0)
    disabled.ingest([decode_timings("r1")])
    assert disabled.drain() == []
    assert disabled.stats() == CollectorStats()
    unbounded = PerfMetricsCollector(AGGREGATED, max_records_per_worker=-1)
    unbounded.ingest([decode_timings(f"r{i}") for i in range(2000)])
    assert len(unbounded.drain()) == 2000


def test_pending_joins_are_bounded() -> None:
    collector = PerfMetricsCollector(DISAGGREGATED, max_pending=2)
    collector.ingest([prefill_timings(f"r{i}") for i in range(3)])
    assert collector.drain() == []
    assert (collector.stats().evicted_incomplete, collector.stats().pending) == (1, 2)
    collector.ingest([decode_timings("r0"), decode_timings("r2")])
    assert [r.request_id for r in collector.drain()] == ["r2"]  # r0's prefill report is gone
    stats = collector.stats()
    assert (stats.evicted_incomplete, stats.pending) == (2, 1)  # r0 (decode) pushed out r1


def test_reported_ids_are_bounded() -> None:
    collector = PerfMetricsCollector(AGGREGATED, max_reported_ids=2)
    collector.ingest([decode_timings(f"r{i}") for i in range(3)])
    assert len(collector.drain()) == 3
    collector.ingest([decode_timings("r2"), decode_timings("r0")])
    # r2 is still remembered; r0 was forgotten, so its repeat is indistinguishable from a new one.
    assert [r.request_id for r in collector.drain()] == ["r0"]
    assert collector.stats().late == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"expected_roles": []}, {"max_records_per_worker": -2}, {"max_pending": 0}],
)
def test_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PerfMetricsCollector(**{"expected_roles": DISAGGREGATED, **kwargs})


def test_ingest_does_not_wait_for_a_slow_join() -> None:
    collector = PerfMetricsCollector(AGGREGATED)
    ingested = threading.Event()

    def writer() -> None:
        collector.ingest([decode_timings("r1")])
        ingested.set()

    with collector._aggregation_lock:  # a reader in the middle of a long join
        thread = threading.Thread(target=writer)
        thread.start()
        assert ingested.wait(timeout=30), "ingest blocked behind the aggregation lock"
    thread.join()
    assert [r.request_id for r in collector.drain()] == ["r1"]


@pytest.mark.parametrize("bound", [-1, 50])
def test_concurrent_writers_and_a_draining_reader(bound: int) -> None:
    # A batch larger than the bound makes drops certain, however fast the reader drains.
    num_workers, per_worker, batch = 4, 384, 64
    collector = PerfMetricsCollector(DISAGGREGATED, max_records_per_worker=bound)
    drained: list[str] = []
    done = threading.Event()

    def writer(worker: int) -> None:
        # Each worker plays both roles for its own requests, in batches like a real worker.
        for start in range(0, per_worker, batch):
            ids = [f"w{worker}-{i}" for i in range(start, start + batch)]
            collector.ingest([prefill_timings(i, worker_id=f"p{worker}") for i in ids])
            collector.ingest([decode_timings(i, worker_id=f"d{worker}") for i in ids])

    def reader() -> None:
        while not done.is_set():
            drained.extend(r.request_id for r in collector.drain())

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(num_workers)]
    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    reader_thread.join()
    drained.extend(r.request_id for r in collector.drain())

    stats = collector.stats()
    total = num_workers * per_worker
    assert len(drained) == len(set(drained)) == stats.joined  # nothing reported twice
    assert stats.ingested == 2 * total
    assert stats.duplicates == stats.late == 0
    if bound == -1:
        assert sorted(drained) == sorted(
            f"w{w}-{i}" for w in range(num_workers) for i in range(per_worker)
        )
        assert stats.dropped == {} and stats.pending == 0
    else:
        # Only records pushed out of a full buffer are missing: every other one is in a joined
        # record (two each) or waits alone for its dropped partner.
        assert stats.total_dropped > 0 and stats.evicted_incomplete == 0
        assert 2 * stats.joined + stats.pending == stats.ingested - stats.total_dropped
        assert stats.joined >= total - stats.total_dropped
