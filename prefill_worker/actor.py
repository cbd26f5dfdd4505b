"""The thin Ray actor around PrefillWorker: builds it from its WorkerSpec and forwards calls."""

from __future__ import annotations

import asyncio
import functools

import ray

from prefill_worker.worker import PrefillWorker
from worker_common.actor_base import WorkerActorBase
from worker_common.engine_setup import build_engine
from worker_common.messages import GenerateRequest, PrefillResult, WorkerSpec
from worker_common.tp_ranks import take_worker_down
from worker_common.transfer_setup import make_publisher


class _PrefillWorkerActor(WorkerActorBase):
    def __init__(self, spec: WorkerSpec) -> None:
        report = self.setup(spec)
        engine = build_engine(spec)
        self.worker = PrefillWorker(
            spec.worker_id,
            engine,
            # Ray runs an async actor's __init__ on the actor's loop: the transceiver runs there too.
            lambda release: make_publisher(engine, spec, release, asyncio.get_running_loop()),
            report,
            spec.deadlines,
            spec.stats_interval_s,
            spec.publish_kv_events,
            on_fatal=functools.partial(take_worker_down, spec.worker_id),
        )

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def cancel(self, request_id: str) -> None:
        await self.worker.cancel(request_id)


PrefillWorkerActor = ray.remote(_PrefillWorkerActor)
