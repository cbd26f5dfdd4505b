"""What both worker actors share: set-up from a WorkerSpec, and the calls that only read or stop the
plain worker behind them.

Each role's actor subclasses this and adds its own request calls; the plain worker is ``self.worker``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from worker_common.kv_events import KVEventPublisher
from worker_common.messages import (
    KVEventPoll,
    KVSnapshot,
    ModelInfo,
    RequestTimings,
    StatsBatch,
    WorkerSpec,
    WorkerStats,
)
from worker_common.request_report import Sink


class WorkerActorBase:
    worker: Any  # PrefillWorker or DecodeWorker

    def setup(self, spec: WorkerSpec) -> Sink | None:
        """Logging as the spec says; the per-request report sink (fire and forget to the
        perf-metrics collector, looked up by name), or None when per-request stats are off."""
        logging.basicConfig(level=spec.log_level)
        logging.getLogger().setLevel(spec.log_level)
        self._stats_released = asyncio.Event()
        self._stats_released.set()
        if spec.collector_name is None:
            return None
        # By name, not as a constructor argument: Ray logs an ERROR for every restartable actor
        # whose arguments hold a reference (ray-project/ray#53727), and a name survives restarts.
        collector = ray.get_actor(spec.collector_name)

        def report(records: list[RequestTimings]) -> None:
            collector.ingest.remote(records)

        return report

    async def ready(self) -> str:
        return self.worker.worker_id

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def model_info(self) -> ModelInfo:
        engine = self.worker.loop.engine
        return ModelInfo(engine.max_model_len, engine.model_config.vocab_size)

    async def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def drain_stats(self) -> StatsBatch:
        batch = self.worker.drain_stats()
        # The test hook: hold the reply of a batch already drained (what a slow worker does).
        await self._stats_released.wait()
        return batch

    async def reset_prefix_cache(self, host_tier: bool) -> bool:
        """Forget every cached prefix page (``host_tier``: the host tier's too); False, changing
        nothing, while a request holds pages here (LLMEngine.reset_prefix_cache)."""
        reset = self.worker.loop.call(lambda engine: engine.reset_prefix_cache(host_tier))
        return bool(await asyncio.wrap_future(reset))

    async def hold_stats_for_test(self, hold: bool) -> None:
        """Test hook: while held, ``drain_stats`` drains and then does not answer."""
        if hold:
            self._stats_released.clear()
        else:
            self._stats_released.set()

    async def fail_next_step_for_test(self) -> None:
        """Test hook: the engine's next step raises, as a bug or a device error in a step would."""

        def arm(engine: Any) -> None:
            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("a step failure injected by fail_next_step_for_test")

            engine.runner.execute = broken

        await asyncio.wrap_future(self.worker.loop.call(arm))

    async def tp_rank_actors_for_test(self) -> list[Any]:
        """Test hook: the Ray actors of ranks 1.. of a tensor-parallel worker ([] otherwise)."""
        ranks = self.worker.loop.engine.local_ranks
        return list(getattr(ranks, "actors", []))

    # ---- KV events (worker_common/kv_events.py) ----
    def _kv_events(self) -> KVEventPublisher:
        publisher = self.worker.kv_events
        if publisher is None:
            raise RuntimeError(f"worker {self.worker.worker_id} does not publish KV events")
        return publisher

    async def kv_events(self, epoch: str | None, after_seq: int, wait_s: float) -> KVEventPoll:
        return await self._kv_events().poll(epoch, after_seq, wait_s)

    async def kv_snapshot(self) -> KVSnapshot:
        publisher = self._kv_events()
        return await asyncio.wrap_future(self.worker.loop.call(publisher.snapshot))

    async def drop_kv_event_batch_for_test(self) -> None:
        """Test hook: the worker's next KV event batch is lost (the router must rebuild)."""
        self._kv_events().drop_next_batch_for_test()

    async def close(self) -> None:
        # Off this actor's event loop: the worker's close waits for pulls (direct reads among
        # them) that only this loop can finish.
        await asyncio.get_running_loop().run_in_executor(None, self.worker.close)
