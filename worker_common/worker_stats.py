"""WorkerStatsKeeper: what both worker roles keep for stats, and how they hand it out.

On the engine thread (the engine loop's tick): the per-request reports (RequestReporter) and the KV
stats interval (KVStatsInterval). On the actor's thread: ``stats()``, a WorkerStats of now, and
``drain()``, the StatsBatch the server's stats poller takes every ``stats.interval_s`` (the engine's
iteration stats and the transceiver's transfer records since the last drain, each handed out once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from engine.engine_core import LLMEngine
from engine.engine_loop import EngineLoop
from transfer.stats import TransferStats
from worker_common.messages import Role, StatsBatch, TransferTotals, WorkerStats
from worker_common.request_report import RequestReporter, Sink, WorkerFacts
from worker_common.stats_interval import KVStatsInterval


class TransferRecords(Protocol):
    """The stats side of a KVSender or KVReceiver."""

    def stats(self) -> dict[str, Any]: ...
    def drain_transfer_stats(self) -> list[TransferStats]: ...


def transfer_totals(
    counters: Mapping[str, Any],
    failures: int | None = None,
    recomputed: int = 0,
    failed_requests: int = 0,
) -> TransferTotals:
    """A transceiver's ``stats()`` counters as TransferTotals (``failures`` overrides its own; a
    decode worker adds what became of its failed pulls' requests)."""
    return TransferTotals(
        transfers_ok=int(counters.get("transfers_ok", 0)),
        failures=int(counters.get("failures", 0) if failures is None else failures),
        bytes=int(counters.get("bytes", 0)),
        expired_leases=int(counters.get("expired_leases", 0)),
        refused_peers=int(counters.get("refused_peers", 0)),
        injected_faults=int(counters.get("injected_faults", 0)),
        wedged_messages=int(counters.get("wedged_messages", 0)),
        refused_pulls=int(counters.get("refused_pulls", 0)),
        rejected_messages=int(counters.get("rejected_messages", 0)),
        recomputed=recomputed,
        failed_requests=failed_requests,
    )


class WorkerStatsKeeper:
    def __init__(self, worker_id: str, role: Role, interval_s: float, report: Sink | None) -> None:
        self.worker_id = worker_id
        self.role = role
        self.reporter = RequestReporter(worker_id, role, report) if report is not None else None
        self.interval = KVStatsInterval(interval_s)

    # ---- engine thread ----
    def tick(self, engine: LLMEngine) -> None:
        if self.reporter is not None:
            self.reporter.tick(engine)
        self.interval.tick(engine)

    def note(self, request_id: str, facts: WorkerFacts) -> None:
        """Engine thread (in the call that adds the request): see RequestReporter."""
        if self.reporter is not None:
            self.reporter.note(request_id, facts)

    def ended_early(
        self,
        request_id: str,
        prompt_tokens: int,
        facts: WorkerFacts,
        finish_reason: str,
        last_report: bool = False,
    ) -> None:
        """Engine thread: see RequestReporter.ended_early."""
        if self.reporter is not None:
            self.reporter.ended_early(request_id, prompt_tokens, facts, finish_reason, last_report)

    def retire(self, request_id: str) -> None:
        """Engine thread (in a call after the request's last one): see RequestReporter."""
        if self.reporter is not None:
            self.reporter.retire(request_id)

    # ---- the worker's event loop ----
    def stats(self, loop: EngineLoop, num_in_flight: int, transfer: TransferTotals) -> WorkerStats:
        # Read from the actor's thread while the engine steps: each number is a plain read.
        engine = loop.engine
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            pid=os.getpid(),
            healthy=loop.alive,
            num_waiting=engine.scheduler.num_waiting,
            num_running=engine.scheduler.num_running,
            num_in_flight=num_in_flight,
            kv=engine.kv.stats(),
            kv_interval=self.interval.last,
            transfer=transfer,
            num_iterations=engine.num_iterations,
        )

    def drain(
        self, stats: WorkerStats, loop: EngineLoop, records: TransferRecords | None
    ) -> StatsBatch:
        return StatsBatch(
            stats=stats,
            iterations=loop.engine.drain_iteration_stats(),
            transfers=records.drain_transfer_stats() if records is not None else [],
        )
