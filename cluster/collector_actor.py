"""The Ray actor around PerfMetricsCollector: a threaded actor, so ingest and drain run concurrently.

All logic lives in ``cluster.collector``; this file only forwards calls. The actor needs no CPU of
its own (``num_cpus=0``): it must never keep a worker from being scheduled.
"""

from __future__ import annotations

from collections.abc import Iterable

import ray

from cluster.collector import PerfMetricsCollector
from cluster.messages import CollectorStats, PerfRecord, RequestClosed
from worker_common.messages import RequestTimings, Role

# Writers from every worker plus one reader; more threads than that only add contention.
COLLECTOR_MAX_CONCURRENCY = 8


class _CollectorActor:
    def __init__(
        self,
        expected_roles: Iterable[Role | str],
        max_records_per_worker: int,
        max_pending: int,
    ) -> None:
        self._collector = PerfMetricsCollector(
            expected_roles,
            max_records_per_worker=max_records_per_worker,
            max_pending=max_pending,
        )

    def ingest(self, records: list[RequestTimings]) -> None:
        self._collector.ingest(records)

    def close(self, closed: RequestClosed) -> None:
        self._collector.close(closed)

    def drain(self) -> list[PerfRecord]:
        return self._collector.drain()

    def stats(self) -> CollectorStats:
        return self._collector.stats()


# A collector that crashed comes back empty (the records it held are lost, the next ones are
# joined as ever); without restarts /perf_metrics stayed empty until the cluster restarted.
COLLECTOR_MAX_RESTARTS = 3

PerfMetricsCollectorActor = ray.remote(
    num_cpus=0, max_concurrency=COLLECTOR_MAX_CONCURRENCY, max_restarts=COLLECTOR_MAX_RESTARTS
)(_CollectorActor)


def start_collector_actor(
    expected_roles: Iterable[Role | str],
    max_records_per_worker: int,
    max_pending: int,
    name: str | None = None,
    namespace: str | None = None,
) -> ray.actor.ActorHandle:
    """Start the collector actor (named, if ``name`` is given, so workers can look it up)."""
    options: dict[str, object] = {}
    if name is not None:
        options["name"] = name
    if namespace is not None:
        options["namespace"] = namespace
    return PerfMetricsCollectorActor.options(**options).remote(
        list(expected_roles), max_records_per_worker, max_pending
    )
