"""KVStatsInterval: the stats interval of a worker's KV cache, kept on its engine thread.

Every ``stats.interval_s`` the worker takes its KV stats (their ``peak_used`` is the interval's
peak) and then resets the peaks (``KVCacheManager.reset_peak``), so the iteration stats of the next
interval carry that interval's peaks only. The snapshot is what ``WorkerStats.kv_interval`` shows,
and what /metrics exports as the peak KV usage.
"""

from __future__ import annotations

import time

from engine.engine_core import LLMEngine
from kvcache.stats import KVCacheStats


class KVStatsInterval:
    """Called on every engine-loop tick; acts once per ``interval_s`` (engine thread only)."""

    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._next = time.monotonic() + interval_s
        self.num_intervals = 0
        # Set on the engine thread, read from the actor's: one reference swap.
        self.last: KVCacheStats | None = None

    def tick(self, engine: LLMEngine) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self.last = engine.kv.stats()
        engine.kv.reset_peak()
        self.num_intervals += 1
        # Intervals missed while a long step ran are not made up: the next one starts now.
        self._next = now + self.interval_s
