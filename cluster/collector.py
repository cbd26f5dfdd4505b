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

from cluster.messages import CollectorStats, PerfRecord, RequestClosed
from worker_common.messages import RequestTimings, Role

UNBOUNDED = -1


def expected_roles_for(aggregated: bool) -> frozenset[Role]:
    """The roles that report every request: only decode when decode workers prefill locally."""
    return frozenset({Role.DECODE}) if aggregated else frozenset({Role.PREFILL, Role.DECODE})


class PerfMetricsCollector:
    """Thread-safe join of per-request timings by request id; each request is handed out once.

    A join completes when every role in ``expected_roles`` has reported (the decode report with
    the prefill report of the same router attempt, ``RequestTimings.prefill_attempt``), or earlier
    when a report says it is the last one (``RequestTimings.last_report``), or when the router
    closed the request (``close``) and its last attempt's report is in. Reports of failed prefill
    attempts before the one a record stands on are left out of it (counted as superseded).
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
        self._pending: OrderedDict[str, _Join] = OrderedDict()
        # Handed-out ids, oldest first, with the prefill attempt their record stands on.
        self._reported: OrderedDict[str, int] = OrderedDict()
        # Closed by the router before the report that completes them arrived.
        self._closed: OrderedDict[str, RequestClosed] = OrderedDict()
        self._closes: list[RequestClosed] = []  # (under the ingest lock, like the buffers)
        self._joined = 0
        self._duplicates = 0
        self._late = 0
        self._superseded = 0
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

    def close(self, closed: RequestClosed) -> None:
        """The router ended a request without a decode worker (``RequestClosed``); kept for the
        next ``drain``."""
        if self._max_per_worker == 0:  # disabled: no report is kept, nothing is to close
            return
        with self._ingest_lock:
            self._closes.append(closed)

    # -- reader ------------------------------------------------------------------------------

    def drain(self) -> list[PerfRecord]:
        """Join everything ingested so far; return the requests completed since the last drain."""
        with self._aggregation_lock:
            with self._ingest_lock:
                buffers, self._buffers = self._buffers, {}
                closes, self._closes = self._closes, []
            # Arrival order within a worker is kept; across workers, and between reports and the
            # router's closes, it does not matter for a join.
            joined = [self._join(record) for buffer in buffers.values() for record in buffer]
            joined += [self._close(closed) for closed in closes]
            completed = [record for record in joined if record is not None]
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
                superseded=self._superseded,
                evicted_incomplete=self._evicted,
                pending=len(self._pending),
            )

    # -- join (aggregation lock held) --------------------------------------------------------

    def _join(self, record: RequestTimings) -> PerfRecord | None:
        request_id = record.request_id
        if request_id in self._reported:
            if record.role is Role.PREFILL and record.prefill_attempt < self._reported[request_id]:
                self._superseded += 1  # a failed attempt's report, after a later one served
            else:
                self._late += 1
            return None
        join = self._pending.get(request_id)
        if join is None:
            join = self._pending[request_id] = _Join(self._closed.pop(request_id, None))
            self._evict_oldest_pending()
        if record.role is Role.DECODE:
            if join.decode is not None:
                self._duplicates += 1
                return None
            join.decode = record
        else:
            if record.prefill_attempt in join.prefills:
                self._duplicates += 1
                return None
            join.prefills[record.prefill_attempt] = record
        return self._complete(request_id, join)

    def _close(self, closed: RequestClosed) -> PerfRecord | None:
        request_id = closed.request_id
        if request_id in self._reported:
            return None
        join = self._pending.get(request_id)
        if join is None:  # its last attempt's report is still on its way
            self._closed[request_id] = closed
            while len(self._closed) > self._max_reported_ids:
                self._closed.popitem(last=False)
            return None
        join.closed = closed
        return self._complete(request_id, join)

    def _complete(self, request_id: str, join: _Join) -> PerfRecord | None:
        """The request's record, once the reports that make it are in."""
        outcome = join.outcome(Role.PREFILL in self.expected_roles)
        if outcome is None:
            return None
        prefill, decode, attempt = outcome
        del self._pending[request_id]
        self._superseded += len(join.prefills) - (prefill is not None)
        self._reported[request_id] = attempt
        if len(self._reported) > self._max_reported_ids:
            self._reported.popitem(last=False)
        return PerfRecord(
            request_id=request_id,
            prefill=prefill,
            decode=decode,
            failed_prefill_attempts=attempt,
            closed_reason=join.closed.reason if join.closed is not None else None,
            closed_decoded_tokens=join.closed.decoded_tokens if join.closed is not None else 0,
        )

    def _evict_oldest_pending(self) -> None:
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self._evicted += 1


class _Join:
    """The reports of one request so far: its prefill attempts' (by attempt), its decode's, and
    the router's close when it ended the request without a decode worker."""

    def __init__(self, closed: RequestClosed | None) -> None:
        self.prefills: dict[int, RequestTimings] = {}
        self.decode: RequestTimings | None = None
        self.closed = closed

    def outcome(
        self, prefill_expected: bool
    ) -> tuple[RequestTimings | None, RequestTimings | None, int] | None:
        """(prefill report, decode report, failed attempts before that prefill) once complete."""
        d = self.decode
        if d is not None:
            if d.last_report or not prefill_expected:  # D prefilled it: no prefill report is its
                return None, d, d.prefill_attempt
            p = self.prefills.get(d.prefill_attempt)  # the attempt whose KV D got
            return None if p is None else (p, d, d.prefill_attempt)
        if not self.prefills:
            return None
        attempt = max(self.prefills)
        p = self.prefills[attempt]
        # It finished on P at its first token, or the router ended it after this attempt.
        if p.last_report or (self.closed is not None and attempt >= self.closed.last_attempt):
            return p, None, attempt
        return None
