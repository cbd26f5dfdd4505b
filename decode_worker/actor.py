"""The thin Ray actor around DecodeWorker: builds it from the cluster config and forwards calls.

``decode`` and ``generate`` are async generators: called with ``num_returns="streaming"`` they
stream TokenDeltas to the router as they are produced.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ray

from cluster.transfer_setup import make_puller
from cluster.worker_actor import WorkerActorBase
from cluster.worker_setup import build_engine
from decode_worker.worker import DecodeWorker
from engine.worker_messages import GenerateRequest, PrefillResult, TokenDelta


class _DecodeWorkerActor(WorkerActorBase):
    def __init__(
        self,
        config: dict[str, Any],
        worker_id: str,
        collector: Any = None,
        transfer_secret: str | None = None,
    ) -> None:
        cfg, report = self.setup(config, collector)
        engine = build_engine(cfg, "decode")
        puller = None if cfg.aggregated else make_puller(engine, cfg, transfer_secret)
        self.worker = DecodeWorker(
            worker_id,
            engine,
            puller,
            report,
            token_deadline_s=cfg.server.request_timeout_s,
            on_failure=cfg.transfer.on_failure,
        )

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        async for delta in self.worker.decode(req, pre):
            yield delta

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async for delta in self.worker.generate(req):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)


DecodeWorkerActor = ray.remote(_DecodeWorkerActor)
