"""The server's read of the perf-metrics collector (cluster/frontend.py) against a real Ray actor:
a drain answered after the read stopped waiting is not lost; the next read takes its records
(the collector's buffers were already emptied by it, and a new drain came back empty). And what
it exports of a worker's KV stats."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import ray

import cluster.frontend as frontend
from cluster.frontend import ClusterFrontend
from cluster.messages import PerfRecord
from cluster.prom_metrics import ServingMetrics
from engine.stats import StatsBuffer
from kvcache.stats import KVCacheStats, PoolGroupStats
from tests.cluster.cluster_fixtures import local_ray
from tests.cluster.conftest import decode_timings, prefill_timings
from worker_common.messages import TransferTotals


@ray.remote(num_cpus=0)
class SlowCollector:
    """Drains once, slowly: the records it hands out are gone from it."""

    def __init__(self) -> None:
        self.records = [PerfRecord("r1", prefill_timings("r1"), decode_timings("r1"))]

    def ready(self) -> bool:
        return True

    async def drain(self) -> list[PerfRecord]:
        records, self.records = self.records, []
        await asyncio.sleep(1.0)
        return records


def test_a_late_collector_answer_is_kept_for_the_next_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(frontend, "COLLECTOR_DRAIN_TIMEOUT_S", 0.2)
    with local_ray("duet-test-frontend"):
        collector = SlowCollector.remote()
        assert ray.get(collector.ready.remote(), timeout=60)  # (started: only its drain is slow)
        server = types.SimpleNamespace(
            collector=collector,
            metrics=ServingMetrics("m"),
            _perf=StatsBuffer(100),
            _perf_lock=threading.Lock(),
            _drain_ref=None,
        )

        async def reads() -> list[int]:
            server._drain_lock = asyncio.Lock()
            sizes = []
            for _ in range(150):  # (bounded, 30 s: the answer comes after about 1 s)
                await ClusterFrontend._drain_collector(server)  # type: ignore[arg-type]
                sizes.append(len(server._perf.drain()))
                if sum(sizes):
                    break
            return sizes

        sizes = asyncio.run(reads())
    assert sizes[0] == 0 and sum(sizes) == 1  # the first read gave up; a later one has it


class _AnsweredCollector:
    """A collector whose drain is answered before the loop awaits it."""

    class drain:  # noqa: N801 (the actor method's name)
        @staticmethod
        def remote() -> asyncio.Future[list[PerfRecord]]:
            answer: asyncio.Future[list[PerfRecord]] = asyncio.get_running_loop().create_future()
            answer.set_result([])
            return answer


def test_the_collector_drain_loop_ends_when_cancelled_as_a_drain_is_answered() -> None:
    """The server's stop cancels the drain loop. A cancel that landed as a drain was answered
    was lost (Python 3.11's asyncio.wait_for returns the answer then, gh-86296): the loop ran on,
    and the server's stop waited for it for ever (a TP cluster test's stop hung, once)."""
    server = types.SimpleNamespace(
        collector=_AnsweredCollector(),
        metrics=ServingMetrics("m"),
        _perf=StatsBuffer(100),
        _perf_lock=threading.Lock(),
        _drain_ref=None,
        stats_interval_s=0.0,
    )
    server._drain_collector = lambda: ClusterFrontend._drain_collector(server)  # type: ignore[arg-type]

    async def cancel_at_every_phase() -> list[bool]:
        server._drain_lock = asyncio.Lock()
        ended = []
        for phase in range(8):  # where the cancel lands in the loop's turn
            loop_task = asyncio.ensure_future(ClusterFrontend._drain_collector_loop(server))  # type: ignore[arg-type]
            for _ in range(phase):
                await asyncio.sleep(0)
            loop_task.cancel()
            done, _ = await asyncio.wait({loop_task}, timeout=2.0)
            ended.append(bool(done))
            if not done:  # one that ran on: without a collector it can lose no cancel
                server.collector = None
                loop_task.cancel()
                await asyncio.wait({loop_task}, timeout=2.0)
                server.collector = _AnsweredCollector()
        return ended

    assert asyncio.run(cancel_at_every_phase()) == [True] * 8


def test_kv_usage_is_the_fullest_groups_and_its_peak_that_groups_own_peak() -> None:
    """kv_cache_usage_perc and its peak read the fullest pool group (each group is a pool of its
    own, and a request needs pages in every one): the window group's 9 of 11 at its peak, though
    all groups together never held more than 13 of 22 (first the sum of each group's own peak,
    then the pages of all groups together, both read as room left while the window was full)."""

    def group(used: int, peak_used: int) -> PoolGroupStats:
        return PoolGroupStats(
            total=11, free=11 - used, used=used, evictable=0, peak_used=peak_used, evictions=0,
            peak_evictable=0, free_low_water=11 - peak_used,
        )  # fmt: skip

    kv = KVCacheStats({"full": group(5, 6), "swa_4": group(2, 9)}, peak_used=13)
    transfer = TransferTotals()
    stats = types.SimpleNamespace(
        role="decode", num_waiting=0, num_running=1, kv=kv, kv_interval=kv, transfer=transfer, pid=1
    )
    server = types.SimpleNamespace(metrics=ServingMetrics("m"))
    worker = types.SimpleNamespace(worker_id="d0", healthy=True, last_stats=stats)
    ClusterFrontend._export_worker(server, worker)  # type: ignore[arg-type]
    labels = {"model_name": "m", "role": "decode", "worker": "d0"}
    registry = server.metrics.registry
    assert registry.get_sample_value("duet:kv_cache_peak_usage_perc", labels) == 9 / 11
    assert registry.get_sample_value("duet:kv_cache_usage_perc", labels) == 5 / 11


def test_a_worker_s_last_failures_are_counted_though_it_went_down_before_the_scrape() -> None:
    """The failures just before a worker goes down: polled, then the router marks it unhealthy,
    then a scrape, then its restarted process (another pid) reports from zero. The scrape while
    it was down skipped its counters and the restart reset the totals: those failures were never
    exported. Counters now take every poll; only the gauges hide while it is down."""
    from cluster.router import Router
    from cluster.worker_choice import WorkerSlot
    from worker_common.messages import ModelInfo, Role, StatsBatch, WorkerStats

    def batch(pid: int, failed: int) -> StatsBatch:
        totals = TransferTotals(failures=failed, failed_requests=failed)
        stats = WorkerStats("d-0", Role.DECODE, pid, True, 0, 0, 0, KVCacheStats(), None,
                            totals, 1)  # fmt: skip
        return StatsBatch(stats, [], [])

    d0 = WorkerSlot("d-0", None)
    server = ClusterFrontend(
        Router([WorkerSlot("p-0", None)], [d0]), None, "m", ModelInfo(512, 128), None
    )
    labels = {"model_name": "m", "role": "decode", "worker": "d-0"}

    def scrape() -> tuple[float | None, float | None]:
        asyncio.run(server.metrics_text())
        registry = server.metrics.registry
        return (
            registry.get_sample_value("duet:kv_transfer_failed_requests_total", labels),
            registry.get_sample_value("duet:num_requests_running", labels),
        )

    server.poller.take(d0, batch(pid=100, failed=2))
    assert scrape() == (2.0, 0.0)
    server.poller.take(d0, batch(pid=100, failed=5))  # 3 more, then it goes down
    d0.healthy = False
    assert scrape() == (5.0, None)  # (its gauges hidden: no current values)
    d0.healthy = True
    server.poller.take(d0, batch(pid=200, failed=0))  # the restarted process
    server.poller.take(d0, batch(pid=200, failed=1))
    assert scrape() == (6.0, 0.0)
    # No scrape between the old process's last batch and the new one's first (a restart
    # within a scrape interval): the old one's last 2 failures were lost.
    server.poller.take(d0, batch(pid=200, failed=3))
    server.poller.take(d0, batch(pid=300, failed=1))
    assert scrape() == (9.0, 0.0)
