"""The thin Ray actor around PrefillWorker: builds it from the cluster config and forwards calls."""

from __future__ import annotations

from typing import Any

import ray

from cluster.transfer_setup import make_publisher
from cluster.worker_actor import WorkerActorBase
from cluster.worker_setup import build_engine
from engine.worker_messages import GenerateRequest, PrefillResult
from prefill_worker.worker import PrefillWorker


class _PrefillWorkerActor(WorkerActorBase):
    def __init__(
        self,
        config: dict[str, Any],
        worker_id: str,
        collector: Any = None,
        transfer_secret: str | None = None,
    ) -> None:
        cfg, report = self.setup(config, collector)
        engine = build_engine(cfg, "prefill")
        self.worker = PrefillWorker(
            worker_id,
            engine,
            lambda release: make_publisher(engine, cfg, release, transfer_secret),
            report,
        )

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def cancel(self, request_id: str) -> None:
        await self.worker.cancel(request_id)


PrefillWorkerActor = ray.remote(_PrefillWorkerActor)
