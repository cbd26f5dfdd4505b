"""The thin Ray actor around DecodeWorker: builds it from the cluster config and forwards calls.

``decode`` and ``generate`` are async generators: called with ``num_returns="streaming"`` they
stream TokenDeltas to the router as they are produced.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from cluster.config import config_from_dict
from cluster.transfer_setup import make_puller
from cluster.worker_setup import build_engine
from decode_worker.worker import DecodeWorker
from engine.worker_messages import GenerateRequest, PrefillResult, TokenDelta


class _DecodeWorkerActor:
    def __init__(self, config: dict[str, Any], worker_id: str, collector: Any = None) -> None:
        logging.basicConfig(level=logging.INFO)
        cfg = config_from_dict(config)
        engine = build_engine(cfg, "decode")
        puller = None if cfg.aggregated else make_puller(engine, cfg)
        report = (lambda t: collector.ingest.remote([t])) if collector is not None else None
        self.worker = DecodeWorker(
            worker_id, engine, puller, report, token_deadline_s=cfg.server.request_timeout_s
        )

    async def ready(self) -> str:
        return self.worker.worker_id

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def max_model_len(self) -> int:
        return self.worker.loop.engine.max_model_len

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        async for delta in self.worker.decode(req, pre):
            yield delta

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async for delta in self.worker.generate(req):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    async def drain_iteration_stats(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in self.worker.drain_iteration_stats()]

    async def close(self) -> None:
        self.worker.close()


DecodeWorkerActor = ray.remote(_DecodeWorkerActor)
