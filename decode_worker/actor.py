"""The thin Ray actor around DecodeWorker: builds it from its WorkerSpec and forwards calls.

``decode`` and ``generate`` are async generators: called with ``num_returns="streaming"`` they
stream TokenDeltas to the router as they are produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import ray

from decode_worker.worker import DecodeWorker
from worker_common.actor_base import WorkerActorBase
from worker_common.engine_setup import build_engine
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta, WorkerSpec
from worker_common.tp_ranks import take_worker_down
from worker_common.transfer_setup import make_puller


class _DecodeWorkerActor(WorkerActorBase):
    def __init__(self, spec: WorkerSpec) -> None:
        report = self.setup(spec)
        engine = build_engine(spec)
        # Ray runs an async actor's __init__ on the actor's loop: the transceiver runs there too.
        loop = asyncio.get_running_loop()
        puller = None if spec.transceiver is None else make_puller(engine, spec, loop)
        self.worker = DecodeWorker(
            spec.worker_id,
            engine,
            puller,
            report,
            spec.deadlines,
            spec.stats_interval_s,
            spec.publish_kv_events,
            on_failure=spec.on_transfer_failure,
            on_fatal=functools.partial(take_worker_down, spec.worker_id),
        )

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        # (closed with this call's stream, not later by the loop: worker.py says why)
        async with contextlib.aclosing(self.worker.decode(req, pre)) as deltas:
            async for delta in deltas:
                yield delta

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async with contextlib.aclosing(self.worker.generate(req)) as deltas:
            async for delta in deltas:
                yield delta

    async def abort(
        self,
        request_id: str,
        prompt_tokens: int | None = None,
        local: bool = False,
        prefill_attempt: int = 0,
    ) -> None:
        await self.worker.abort(request_id, prompt_tokens, local, prefill_attempt)


DecodeWorkerActor = ray.remote(_DecodeWorkerActor)
