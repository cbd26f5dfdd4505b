"""RequestReporter: a worker's per-request stats, from its engine's request stats to the collector.

The engine records one RequestStats per request (engine/stats.py: timestamps, prompt, cached and
output tokens, preemptions, token gaps) in a buffer of ``stats.perf_buffer_len`` records. The
reporter drains that buffer on the engine thread (``EngineLoop``'s tick, before the finished
request's consumer hears of it), adds what only the worker knows (when the request reached it, and
on a decode worker its KV transfer), and sends each as a RequestTimings to the perf-metrics
collector, which joins P's and D's reports of a request for /perf_metrics.

With ``perf_buffer_len: 0`` the engine records nothing and the worker has no reporter: nothing is
built, nothing is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine_core import LLMEngine
from engine.stats import RequestStats
from worker_common.messages import RequestTimings, Role

Sink = Callable[[list[RequestTimings]], None]
FAILED = frozenset({"error", "abort"})  # finish reasons of a request that did not finish normally


@dataclass(frozen=True)
class TransferFacts:
    """A decode worker's KV transfer of one request, as its pull saw it."""

    start: float
    end: float
    bytes: int
    path: str | None  # None: the pull could not run at all


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker knows of a request that its engine does not."""

    received: float  # the request reached this worker
    transfer: TransferFacts | None = None  # D: the KV came from a prefill worker
    prefill_attempt: int = 0  # the router's (GenerateRequest.prefill_attempt)
    router_arrival: float | None = None  # the request reached the router (its arrival_time)


class RequestReporter:
    """Joins a worker's facts to its engine's RequestStats. Everything here runs on the engine
    thread (inside ``EngineLoop.call`` or its tick), so it needs no lock.

    ``note(request_id, facts)`` in the same call that adds the request to the engine;
    ``retire(request_id)`` in a call made once the request's consumer is done with it (after the
    call that aborted it, if it did): the next tick reports what the engine recorded first, then
    drops facts still unclaimed (their request never reached the engine, or the buffer's bound
    dropped its stats), so nothing is kept for ever.
    """

    def __init__(self, worker_id: str, role: Role, sink: Sink) -> None:
        self.worker_id = worker_id
        self.role = role
        self._sink = sink
        self._facts: dict[str, WorkerFacts] = {}
        self._retired: list[str] = []

    def note(self, request_id: str, facts: WorkerFacts) -> None:
        self._facts[request_id] = facts

    def retire(self, request_id: str) -> None:
        self._retired.append(request_id)

    def ended_early(
        self,
        request_id: str,
        prompt_tokens: int,
        facts: WorkerFacts,
        finish_reason: str,
        last_report: bool = False,
    ) -> None:
        """Report a request that ended on this worker before its engine saw it (its client went
        away while its pages were awaited or its KV travelled, or its transfer failed): the engine
        records nothing for it, and without this report /perf_metrics would never show it.
        ``last_report``: no other worker will report it (one this worker was to prefill)."""
        transfer = facts.transfer
        self._sink(
            [
                RequestTimings(
                    request_id=request_id,
                    role=self.role,
                    worker_id=self.worker_id,
                    arrival_time=facts.received,
                    router_arrival_time=facts.router_arrival,
                    transfer_start=transfer.start if transfer else None,
                    transfer_end=transfer.end if transfer else None,
                    transfer_bytes=transfer.bytes if transfer else 0,
                    transfer_path=transfer.path if transfer else None,
                    finish_time=time.time(),
                    prompt_tokens=prompt_tokens,
                    finish_reason=finish_reason,
                    last_report=last_report,
                    prefill_attempt=facts.prefill_attempt,
                )
            ]
        )

    @property
    def num_facts(self) -> int:
        return len(self._facts)

    def tick(self, engine: LLMEngine) -> None:
        """Report every request the engine recorded since the last tick, then drop retired facts."""
        records = engine.drain_request_stats()
        if records:
            facts = [self._facts.pop(r.request_id, None) for r in records]
            self._sink([self._timings(r, f) for r, f in zip(records, facts)])
        if self._retired:
            for request_id in self._retired:
                self._facts.pop(request_id, None)
            self._retired.clear()

    def _timings(self, stats: RequestStats, facts: WorkerFacts | None) -> RequestTimings:
        m = stats.metrics
        transfer = facts.transfer if facts is not None else None
        handed_off = stats.finish_reason is None
        local_prompt = transfer is None  # this worker computed the prompt (P, or D prefilling)
        finish_reason = "error" if stats.error else stats.finish_reason
        return RequestTimings(
            request_id=stats.request_id,
            role=self.role,
            worker_id=self.worker_id,
            arrival_time=facts.received if facts is not None else m.arrival_time,
            router_arrival_time=facts.router_arrival if facts is not None else None,
            # (from this worker's arrival: D's engine holds the router's, for the request's TTFT)
            queue_start=(facts.received if facts is not None else m.arrival_time)
            if local_prompt
            else (transfer.end if transfer else None),
            queue_end=m.first_scheduled_time,
            prefill_start=m.first_scheduled_time if local_prompt else None,
            prefill_end=m.first_token_time if local_prompt else None,
            first_token_time=m.first_token_time if local_prompt else None,
            transfer_start=transfer.start if transfer else None,
            transfer_end=transfer.end if transfer else None,
            transfer_bytes=transfer.bytes if transfer else 0,
            transfer_path=transfer.path if transfer else None,
            decode_start=None if self.role is Role.PREFILL else m.first_scheduled_time,
            last_token_time=m.last_token_time,
            finish_time=None if handed_off else (m.finished_time or time.time()),
            prompt_tokens=m.num_prompt_tokens,
            cached_tokens=m.num_cached_tokens,
            cached_tokens_by_medium=_by_medium(m.num_cached_tokens, m.num_cached_host_tokens),
            # A transferred request's first token was sampled (and is reported) by P.
            output_tokens=m.num_output_tokens - (transfer is not None and m.num_output_tokens > 0),
            num_preemptions=m.num_preemptions,
            token_gaps_s=stats.token_gaps_s,
            finish_reason=finish_reason,
            # P's report is the last one when the request finished on it; not when it failed (the
            # router may try again) or was handed off. D's when it prefilled the request itself
            # (no prefill worker will report it).
            last_report=(
                not handed_off and finish_reason not in FAILED
                if self.role is Role.PREFILL
                else local_prompt
            ),
            prefill_attempt=facts.prefill_attempt if facts is not None else 0,
        )


def _by_medium(cached: int, host: int) -> dict[str, int]:
    """A prefix hit split by where its pages were: the device pool, or loaded back from host."""
    split = {"device": cached - host, "host": host}
    return {medium: n for medium, n in split.items() if n}
