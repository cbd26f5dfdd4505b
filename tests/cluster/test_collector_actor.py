"""The collector as a Ray actor on a real local Ray: workers ingest from other processes while a
reader drains, and each request comes out exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from cluster.collector import expected_roles_for
from cluster.collector_actor import COLLECTOR_MAX_CONCURRENCY, start_collector_actor
from cluster.messages import CollectorStats, RequestTimings
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from tests.cluster.conftest import decode_timings, prefill_timings

NAMESPACE = "duet-test-collector"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray(NAMESPACE):
        yield


@ray.remote(num_cpus=0)
def report(actor_name: str, batches: list[list[RequestTimings]]) -> int:
    """A stand-in for a worker process: finds the collector by name and reports in batches."""
    collector = ray.get_actor(actor_name, namespace=NAMESPACE)
    ray.get([collector.ingest.remote(batch) for batch in batches])
    return sum(len(batch) for batch in batches)


def test_actor_joins_reports_from_other_processes(local_ray: None) -> None:
    assert COLLECTOR_MAX_CONCURRENCY > 1
    collector = start_collector_actor(
        expected_roles_for(aggregated=False),
        max_records_per_worker=-1,
        max_pending=1000,
        name="perf-collector",
        namespace=NAMESPACE,
    )
    ids = [f"r{i}" for i in range(200)]
    prefill_batches = [[prefill_timings(i) for i in ids[k : k + 20]] for k in range(0, 200, 20)]
    decode_batches = [[decode_timings(i) for i in ids[k : k + 20]] for k in range(0, 200, 20)]
    reporters = [
        report.remote("perf-collector", prefill_batches),
        report.remote("perf-collector", decode_batches),
    ]
    # Drain while the reporters are still sending; the threaded actor serves both at once.
    drained = []
    pending = list(reporters)
    while pending:
        drained += ray.get(collector.drain.remote())
        _, pending = ray.wait(pending, timeout=0)
    assert ray.get(reporters) == [200, 200]
    drained += ray.get(collector.drain.remote())

    assert sorted(r.request_id for r in drained) == sorted(ids)
    first = next(r for r in drained if r.request_id == "r7")
    assert (first.prefill, first.decode) == (prefill_timings("r7"), decode_timings("r7"))
    assert first.ttft_s == 0.75
    assert ray.get(collector.stats.remote()) == CollectorStats(ingested=400, joined=200)
    ray.kill(collector)


def test_the_collector_of_a_config_keeps_stats_max_pending_joins_partial_joins(
    local_ray: None,
) -> None:
    from cluster.builder import start_collector
    from cluster.config import config_from_dict

    # stats.max_pending_joins: partial joins kept waiting for their other role.
    config = config_from_dict({"stats": {"max_pending_joins": 2, "perf_buffer_len": 5}})
    collector = start_collector(config, "collector-of-a-config")
    # Three requests handed off by P whose decode report never comes: the oldest is dropped.
    ray.get(collector.ingest.remote([prefill_timings(f"r{i}") for i in range(3)]))
    assert ray.get(collector.drain.remote()) == []
    stats = ray.get(collector.stats.remote())
    assert (stats.pending, stats.evicted_incomplete) == (2, 1)
    # stats.perf_buffer_len: each worker's newest 5 records are kept between drains.
    ray.get(collector.ingest.remote([decode_timings(f"d{i}", last_report=True) for i in range(8)]))
    drained = ray.get(collector.drain.remote())
    assert [r.request_id for r in drained] == [f"d{i}" for i in range(3, 8)]
    assert ray.get(collector.stats.remote()).dropped == {"d0": 3}
    ray.kill(collector)


def test_a_crashed_collector_comes_back_and_joins_again(local_ray: None) -> None:
    """A collector process that dies (killed here, as the OOM killer would) is restarted by Ray:
    the workers' reports after it are joined and drained as before (it stayed dead)."""
    collector = start_collector_actor(
        expected_roles_for(aggregated=False), -1, 1000, name="crashy", namespace=NAMESPACE
    )
    ray.get(collector.ingest.remote([prefill_timings("before")]), timeout=60)
    ray.kill(collector, no_restart=False)
    for _ in range(600):  # bounded: 60 s
        try:
            ray.get(collector.stats.remote(), timeout=5)
            break
        except ray.exceptions.RayActorError:
            time.sleep(0.1)
    batches = [[t("a1")] for t in (prefill_timings, decode_timings)]
    batches += [[t("a2")] for t in (prefill_timings, decode_timings)]
    ray.get(report_each.remote("crashy", batches), timeout=60)
    drained = [r.request_id for r in ray.get(collector.drain.remote(), timeout=60)]
    assert "a2" in drained and "before" not in drained


@ray.remote(num_cpus=0)
def report_each(actor_name: str, batches: list[list[RequestTimings]]) -> None:
    """As a worker reports (actor_base: one call a batch, its answer not awaited, so a failed one
    is a lost batch): a process whose handle has not yet heard of the restart loses its first
    call to ActorUnavailableError."""
    collector = ray.get_actor(actor_name, namespace=NAMESPACE)
    for batch in batches:
        try:
            ray.get(collector.ingest.remote(batch), timeout=30)
        except ray.exceptions.ActorUnavailableError:
            pass
