"""PerfMetricsCollector: joins the prefill and decode workers' timings of each request.

Writers (workers, through the actor) call ``ingest``; a reader (the HTTP server) calls ``drain``.
Two locks keep a slow reader from blocking writers:

- the ingest lock guards only the per-worker buffers: ``ingest`` appends under it, and ``drain``
  holds it just long enough to swap the buffers for empty ones;
- the aggregation lock guards the join state (partial joins, ids already handed out) and is held by
  ``drain`` while it joins, never by ``ingest``.

Bounds: each worker's buffer keeps its newest ``max_records_per_worker`` records (-1 unbounded,
0 disabled: nothing is stored; the ``max_stats_len`` convention), pushing out the oldest and counting
it; at most ``max_pending`` requests wait for a missing role (the oldest partial join is evicted and
counted); the ids of the last ``max_reported_ids`` handed-out requests are remembered so a late or
repeated report never yields a second record.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable

from cluster.messages import CollectorStats, PerfRecord
from worker_common.messages import RequestTimings, Role

UNBOUNDED = -1


def expected_roles_for(aggregated: bool) -> frozenset[Role]:
    """The roles that report every request: only decode when decode workers prefill locally."""
    return frozenset({Role.DECODE}) if aggregated else frozenset({Role.PREFILL, Role.DECODE})


class PerfMetricsCollector:
    """Thread-safe join of per-request timings by request id; each request is handed out once.

    A join completes when every role in ``expected_roles`` has reported, or earlier when a report
    says it is the last one (``RequestTimings.last_report``).
    """

    def __init__(
        self,
        expected_roles: Iterable[Role | str],
        max_records_per_worker: int = 10_000,
        max_pending: int = 10_000,
        max_reported_ids: int = 100_000,
    ) -> None:
        self.expected_roles = frozenset(Role(role) for role in expected_roles)
        if not self.expected_roles:
            raise ValueError("expected_roles must name at least one of 'prefill', 'decode'")
        if max_records_per_worker < UNBOUNDED:
            raise ValueError(
                f"max_records_per_worker must be -1 (unbounded), 0 (disabled) or N > 0, "
                f"got {max_records_per_worker}"
            )
        if max_pending < 1 or max_reported_ids < 1:
            raise ValueError(
                f"max_pending and max_reported_ids must be >= 1, got {max_pending}, {max_reported_ids}"
            )
        self._max_per_worker = max_records_per_worker
        self._max_pending = max_pending
        self._max_reported_ids = max_reported_ids

        self._ingest_lock = threading.Lock()
        self._buffers: dict[str, deque[RequestTimings]] = {}  # worker id -> newest records
        self._ingested = 0
        self._dropped: dict[str, int] = {}

        self._aggregation_lock = threading.Lock()
        self._pending: OrderedDict[str, dict[Role, RequestTimings]] = OrderedDict()
        self._reported: OrderedDict[str, None] = OrderedDict()  # an ordered set, oldest first
        self._joined = 0
        self._duplicates = 0
        self._late = 0
        self._evicted = 0

    # -- writers -----------------------------------------------------------------------------

    def ingest(self, records: Iterable[RequestTimings]) -> None:
        """Buffer records for the next ``drain``. Never waits for a reader's join."""
        records = list(records)
        if self._max_per_worker == 0:
            return
        with self._ingest_lock:
            for record in records:
                buffer = self._buffers.get(record.worker_id)
                if buffer is None:
                    buffer = self._buffers[record.worker_id] = deque()
                if len(buffer) == self._max_per_worker:
                    buffer.popleft()
                    self._dropped[record.worker_id] = self._dropped.get(record.worker_id, 0) + 1
                buffer.append(record)
                self._ingested += 1

    # -- reader ------------------------------------------------------------------------------

    def drain(self) -> list[PerfRecord]:
        """Join everything ingested so far; return the requests completed since the last drain."""
        with self._aggregation_lock:
            with self._ingest_lock:
                buffers, self._buffers = self._buffers, {}
            # Arrival order within a worker is kept; across workers it does not matter for a join.
            completed: list[PerfRecord] = []
            for buffer in buffers.values():
                for record in buffer:
                    joined = self._join(record)
                    if joined is not None:
                        completed.append(joined)
            self._joined += len(completed)
            return completed

    def stats(self) -> CollectorStats:
        with self._ingest_lock:
            ingested, dropped = self._ingested, dict(self._dropped)
        with self._aggregation_lock:
            return CollectorStats(
                ingested=ingested,
                dropped=dropped,
                joined=self._joined,
                duplicates=self._duplicates,
                late=self._late,
                evicted_incomplete=self._evicted,
                pending=len(self._pending),
            )

    # -- join (aggregation lock held) --------------------------------------------------------

    def _join(self, record: RequestTimings) -> PerfRecord | None:
        request_id = record.request_id
        if request_id in self._reported:
            self._late += 1
            return None
        parts = self._pending.get(request_id)
        if parts is None:
            parts = self._pending[request_id] = {}
            self._evict_oldest_pending()
        if record.role in parts:
            self._duplicates += 1
            return None
        parts[record.role] = record
        if not (record.last_report or self.expected_roles <= parts.keys()):
            return None
        del self._pending[request_id]
        self._reported[request_id] = None
        if len(self._reported) > self._max_reported_ids:
            self._reported.popitem(last=False)
        return PerfRecord(
            request_id=request_id, prefill=parts.get(Role.PREFILL), decode=parts.get(Role.DECODE)
        )

    def _evict_oldest_pending(self) -> None:
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self._evicted += 1
