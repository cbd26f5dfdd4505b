"""The serving backend of the HTTP server: tokenizer, router, metrics and perf records together."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from cluster.prom_metrics import ServingMetrics
from cluster.router import Router, WorkerSlot
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.worker_messages import GenerateRequest, TokenDelta

log = logging.getLogger(__name__)


class ClusterFrontend:
    """Implements ``cluster.server.ServingBackend`` on top of the router and the collector actor."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer | None,
        model_name: str,
        max_model_len: int,
        collector: Any,  # the perf-metrics collector actor handle
        perf_buffer_len: int = 10000,
        default_max_tokens: int = 16,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.collector = collector
        self.metrics = ServingMetrics(model_name)
        # /perf_metrics is drained on read; what nobody read yet is kept up to the bound.
        self._perf: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(perf_buffer_len, 1)
        )
        self._drain_lock = asyncio.Lock()

    # ---- request path ----
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_name!r} has no tokenizer (random weights): send token ids"
            )
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._require_tokenizer().encode_chat(messages, add_generation_prompt=True)

    def validate_sampling(self, sampling: dict[str, Any]) -> None:
        SamplingParams(**sampling)  # raises ValueError naming the field

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.router.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.router.abort(request_id)

    # ---- observability ----
    async def health(self) -> dict[str, Any]:
        return await self.router.health()

    async def _drain_collector(self) -> None:
        async with self._drain_lock:
            try:
                records = await asyncio.wait_for(self.collector.drain.remote(), 10.0)
            except Exception as e:  # the collector is an aid, never a reason to fail a scrape
                log.warning("perf-metrics collector did not answer: %s", e)
                return
            for record in records:
                self.metrics.observe_request(record)
                self._perf.append(record.to_dict())

    async def metrics_text(self) -> bytes:
        await self._drain_collector()
        await self.router.refresh_stats()
        for w in self.router.prefill + self.router.decode:
            self._export_worker(w)
        return self.metrics.render()

    def _export_worker(self, w: WorkerSlot) -> None:
        s = w.last_stats
        if not s:
            return
        kv = s.get("kv")
        usage = 0.0
        if kv is not None:
            total = sum(g.total for g in kv.groups.values()) if hasattr(kv, "groups") else 0
            used = sum(g.used for g in kv.groups.values()) if hasattr(kv, "groups") else 0
            usage = used / total if total else 0.0
        transfer = s.get("transfer") or {}
        self.metrics.set_worker_stats(
            w.worker_id,
            s["role"],
            s.get("num_waiting", 0),
            s.get("num_running", 0),
            min(max(usage, 0.0), 1.0),
            # One count, not both: a decode worker's own ``transfer_failures`` counts every
            # failed pull its transceiver counts, plus pulls that could not run at all.
            transfer_failures_total=int(s.get("transfer_failures", transfer.get("failures", 0))),
            expired_leases_total=int(transfer.get("expired_leases", 0)),
            transfer_recomputed=int(s.get("transfer_recomputed", 0)),
            transfer_failed_requests=int(s.get("transfer_failed_requests", 0)),
            refused_peers=int(transfer.get("refused_peers", 0)),
            injected_faults=int(transfer.get("injected_faults", 0)),
        )

    async def perf_metrics(self) -> list[dict[str, Any]]:
        await self._drain_collector()
        out = list(self._perf)
        self._perf.clear()
        return out

    async def iteration_stats(self) -> dict[str, list[dict[str, Any]]]:
        workers = self.router.prefill + self.router.decode

        async def one(w: WorkerSlot) -> list[dict[str, Any]]:
            try:
                return await asyncio.wait_for(w.handle.drain_iteration_stats.remote(), 10.0)
            except Exception as e:
                log.warning("iteration stats of %s unavailable: %s", w.worker_id, e)
                return []

        results = await asyncio.gather(*(one(w) for w in workers))
        return {w.worker_id: r for w, r in zip(workers, results)}
