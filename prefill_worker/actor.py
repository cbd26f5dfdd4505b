"""The thin Ray actor around PrefillWorker: builds it from the cluster config and forwards calls."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

from cluster.config import config_from_dict
from cluster.transfer_setup import make_publisher
from cluster.worker_setup import build_engine
from engine.worker_messages import GenerateRequest, PrefillResult
from prefill_worker.worker import PrefillWorker


class _PrefillWorkerActor:
    def __init__(self, config: dict[str, Any], worker_id: str, collector: Any = None) -> None:
        logging.basicConfig(level=logging.INFO)
        cfg = config_from_dict(config)
        engine = build_engine(cfg, "prefill")
        report = (lambda t: collector.ingest.remote([t])) if collector is not None else None
        self.worker = PrefillWorker(
            worker_id, engine, lambda release: make_publisher(engine, cfg, release), report
        )

    async def ready(self) -> str:
        return self.worker.worker_id

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def max_model_len(self) -> int:
        return self.worker.loop.engine.max_model_len

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def cancel(self, request_id: str) -> None:
        await self.worker.cancel(request_id)

    async def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    async def drain_iteration_stats(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in self.worker.drain_iteration_stats()]

    async def close(self) -> None:
        self.worker.close()


PrefillWorkerActor = ray.remote(_PrefillWorkerActor)
