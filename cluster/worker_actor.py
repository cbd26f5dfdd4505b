"""What both worker actors share: the calls that only read or stop the plain worker behind them.

Each role's actor subclasses this and adds its own request calls; the plain worker is ``self.worker``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray

from cluster.config import ClusterConfig, config_from_dict
from cluster.messages import RequestTimings


class WorkerActorBase:
    worker: Any  # PrefillWorker or DecodeWorker

    @staticmethod
    def setup(
        config: dict[str, Any], collector: Any
    ) -> tuple[ClusterConfig, Callable[[RequestTimings], None] | None]:
        """The validated config, and the timings reporter (fire and forget to the collector)."""
        logging.basicConfig(level=logging.INFO)
        report = (lambda t: collector.ingest.remote([t])) if collector is not None else None
        return config_from_dict(config), report

    async def ready(self) -> str:
        return self.worker.worker_id

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def max_model_len(self) -> int:
        return self.worker.loop.engine.max_model_len

    async def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    async def drain_iteration_stats(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in self.worker.loop.engine.drain_iteration_stats()]

    async def close(self) -> None:
        # Off this actor's event loop: the worker's close waits for pulls (direct reads among
        # them) that only this loop can finish.
        await asyncio.get_running_loop().run_in_executor(None, self.worker.close)
