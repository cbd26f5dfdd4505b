"""What the perf-metrics collector hands the server: joined per-request records, and its counters.

Workers report one ``RequestTimings`` per request and role (worker_common/messages.py); the
collector joins the reports of one request into a ``PerfRecord``. Everything here is plain data, so
it pickles cheaply through Ray and dumps to JSON for ``/perf_metrics``.

Clocks: a duration between two timestamps of the same record uses one clock; a duration that spans
two roles (e.g. end-to-end latency from the prefill worker's arrival to the decode worker's finish)
also includes the clock skew between the two hosts, negligible on one host and NTP-sized across.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from worker_common.messages import RequestTimings, Role


def _plain(timings: RequestTimings | None) -> dict[str, Any] | None:
    """The timings as JSON-ready built-ins (the role as its string value, gaps as a list)."""
    if timings is None:
        return None
    fields = asdict(timings)
    fields["role"] = timings.role.value
    fields["token_gaps_s"] = list(timings.token_gaps_s)
    return fields


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(frozen=True)
class PerfRecord:
    """One request's joined timings: the prefill report (None when the decode worker prefilled
    locally) and the decode report (None when the request ended on the prefill worker).

    After failed prefill attempts (the router tried another prefill worker, or had the decode
    worker prefill it), ``prefill`` is the report of the attempt that served the request (or of
    the last one, when none did) and ``failed_prefill_attempts`` counts those before it; their
    own reports are left out. TTFT and end-to-end latency run from the request's arrival at the
    router (``RequestTimings.router_arrival_time``; failed attempts and the router's wait are in
    them, as a client sees them), or, for reports that lack it, from the first worker's."""

    request_id: str
    prefill: RequestTimings | None
    decode: RequestTimings | None
    failed_prefill_attempts: int = 0
    closed_reason: str | None = None  # the router's RequestClosed.reason, when it closed it
    # The router's RequestClosed.decoded_tokens: what a decode worker that failed streamed
    closed_decoded_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prefill is None and self.decode is None:
            raise ValueError(f"PerfRecord {self.request_id!r}: needs at least one role's timings")

    @property
    def _first(self) -> RequestTimings:
        """The report of the role that received the request first."""
        return self.prefill if self.prefill is not None else self.decode  # type: ignore[return-value]

    @property
    def _last(self) -> RequestTimings:
        """The report of the role that finished the request."""
        return self.decode if self.decode is not None else self.prefill  # type: ignore[return-value]

    @property
    def _prefiller(self) -> RequestTimings:
        """The report of the role that sampled the first token: D when it prefilled the request
        on its local path, else P (D recomputing after a failed transfer reports no prefill of
        its own: the client's first token was P's)."""
        if self.decode is not None and self.decode.prefill_start is not None:
            return self.decode
        return self._first

    @property
    def arrival_time(self) -> float | None:
        return self._first.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self._prefiller.first_token_time

    @property
    def request_arrival_time(self) -> float | None:
        """The request reached the router (the first worker, in a report without it)."""
        first = self._first
        return (
            first.router_arrival_time
            if first.router_arrival_time is not None
            else first.arrival_time
        )

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from the request's arrival at the router."""
        return _span(self.request_arrival_time, self.first_token_time)

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency, from the request's arrival at the router to the finishing worker's
        release."""
        return _span(self.request_arrival_time, self._last.finish_time)

    @property
    def prefill_time_s(self) -> float | None:
        return _span(self._prefiller.prefill_start, self._prefiller.prefill_end)

    @property
    def transfer_latency_s(self) -> float | None:
        """KV transfer as the receiver saw it; the sender's view when D did not report it."""
        if self.decode is not None and self.decode.transfer_end is not None:
            return _span(self.decode.transfer_start, self.decode.transfer_end)
        if self.prefill is not None:
            return _span(self.prefill.transfer_start, self.prefill.transfer_end)
        return None

    @property
    def transfer_bytes(self) -> int:
        if self.decode is not None and self.decode.transfer_bytes:
            return self.decode.transfer_bytes
        return self.prefill.transfer_bytes if self.prefill is not None else 0

    @property
    def decode_time_s(self) -> float | None:
        """The decode worker's generation: its first step with the request to its last token."""
        if self.decode is None:
            return None
        return _span(self.decode.decode_start, self.decode.last_token_time)

    @property
    def prompt_tokens(self) -> int:
        return self._prefiller.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefilling worker found in its prefix cache."""
        return self._prefiller.cached_tokens

    @property
    def _reported_tokens(self) -> int:
        """The output tokens the reports account for, the first one included."""
        if self.prefill is not None and self.decode is not None and self._prefiller is self.prefill:
            return self.prefill.output_tokens + self.decode.output_tokens
        return self._last.output_tokens

    @property
    def output_tokens(self) -> int:
        """All output tokens the client got, the first one (sampled by the prefiller) included,
        and those of a decode worker that failed before it reported."""
        return self._reported_tokens + self.closed_decoded_tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (outputs - 1), of
        the reported tokens (a failed decode worker's have no times)."""
        span = _span(self.first_token_time, self._last.last_token_time)
        if span is None or self._reported_tokens < 2:
            return None
        return span / (self._reported_tokens - 1)

    @property
    def token_gaps_s(self) -> tuple[float, ...]:
        """Inter-token latencies: each worker's own gaps and, when P sampled the first token and
        D the next ones, the gap between them (the KV transfer is in it; D's first sampled token
        came ``sum(D's gaps)`` before its last). So the gaps add up to TPOT x (outputs - 1)."""
        prefill_gaps = self.prefill.token_gaps_s if self.prefill is not None else ()
        decode_gaps = self.decode.token_gaps_s if self.decode is not None else ()
        handoff: tuple[float, ...] = ()
        p, d = self.prefill, self.decode
        if (
            p is not None
            and d is not None
            and self._prefiller is p
            and d.output_tokens > 0
            and p.first_token_time is not None
            and d.last_token_time is not None
        ):
            first_on_d = d.last_token_time - sum(decode_gaps)
            handoff = (max(first_on_d - p.first_token_time, 0.0),)  # (two hosts' clocks)
        return prefill_gaps + handoff + decode_gaps

    @property
    def finish_reason(self) -> str | None:
        return self._last.finish_reason or self.closed_reason

    def queue_time_s(self, role: Role) -> float | None:
        timings = self.prefill if role is Role.PREFILL else self.decode
        return None if timings is None else _span(timings.queue_start, timings.queue_end)

    def to_dict(self) -> dict[str, Any]:
        """One ``/perf_metrics`` entry: the derived times in seconds, under the names that
        ``cluster.bench.perf_metrics`` reads, plus both roles' raw timings."""
        return {
            "request_id": self.request_id,
            "prefill_queue_time": self.queue_time_s(Role.PREFILL),
            "prefill_time": self.prefill_time_s,
            "transfer_time": self.transfer_latency_s,
            "transfer_bytes": self.transfer_bytes,
            "transfer_path": self.decode.transfer_path if self.decode is not None else None,
            "decode_queue_time": self.queue_time_s(Role.DECODE),
            "decode_time": self.decode_time_s,
            "ttft": self.ttft_s,
            "tpot": self.tpot_s,
            "e2e": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_by_medium": dict(self._prefiller.cached_tokens_by_medium),
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "failed_prefill_attempts": self.failed_prefill_attempts,
            "prefill": _plain(self.prefill),
            "decode": _plain(self.decode),
        }


@dataclass(frozen=True)
class RequestClosed:
    """The router ended a request without a decode worker's report (its client went away before
    one took it, no prefill attempt succeeded and there was no fallback, or the decode worker
    died): the report of prefill attempt
    ``last_attempt`` (the last whose worker reports it; a worker that died reports nothing)
    completes the request's record, which ends with ``reason`` ("abort", "error") where that
    report has no finish of its own (it had handed the request off). Or a decode worker failed
    mid-stream, after ``decoded_tokens`` tokens."""

    request_id: str
    last_attempt: int
    reason: str = "abort"
    # Output tokens a decode worker streamed to the client before it failed (it reports nothing)
    decoded_tokens: int = 0

    def __post_init__(self) -> None:
        if self.last_attempt < 0:
            raise ValueError(f"RequestClosed {self.request_id!r}: no attempt reports it")


@dataclass(frozen=True)
class CollectorStats:
    """Counters of the perf-metrics collector since it started."""

    ingested: int = 0  # records accepted into a worker buffer
    dropped: dict[str, int] = field(default_factory=dict)  # per worker: oldest records pushed out
    joined: int = 0  # PerfRecords handed out by drain()
    duplicates: int = 0  # a second report of the same role for a request still being joined
    late: int = 0  # a report for a request that was already handed out
    superseded: int = 0  # a failed prefill attempt's report, left out for a later attempt's
    evicted_incomplete: int = 0  # partial joins pushed out by the pending bound
    pending: int = 0  # requests waiting for another role's report

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())
