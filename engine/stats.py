"""Iteration and request statistics, buffered for readers that must never block the step loop."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.request import FinishReason, RequestMetrics
from kvcache.stats import KVCacheStats

T = TypeVar("T")


@dataclass(frozen=True)
class IterationStats:
    """One engine step."""

    iteration: int
    timestamp: float  # time.time() at the end of the step
    batch_size: int  # requests in the forward pass
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int  # after the step
    num_waiting: int
    num_preempted: int  # preemptions decided in this step
    num_finished: int
    step_time_s: float  # schedule + batch + forward + sample + update
    kv: KVCacheStats


@dataclass(frozen=True)
class RequestStats:
    """One request as this engine saw it, recorded once: when it finished, or, for a prefill-only
    request, when its first token was sampled and its pages were kept for a transfer (then
    ``finish_reason`` is None: the request was handed off)."""

    request_id: str
    finish_reason: FinishReason | None
    metrics: RequestMetrics  # a copy taken when recorded
    token_gaps_s: tuple[float, ...] = ()  # between consecutive tokens this engine sampled
    error: str | None = None  # why the engine failed it (finish_reason "abort")


class StatsBuffer(Generic[T]):
    """Bounded FIFO of stats records.

    ``max_len``: -1 keeps everything, 0 stores nothing (``enabled`` is False, so producers can skip
    building records), N keeps exactly the last N. ``drain()`` pops items one at a time: deque
    ``append``/``popleft`` are atomic under the GIL, so a reader in another thread needs no lock and
    never blocks the writer.
    """

    def __init__(self, max_len: int) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < -1:
            raise ValueError(
                f"max_stats_len must be -1 (unbounded), 0 (disabled) or N >= 1, got {max_len!r}"
            )
        self.max_len = max_len
        self._items: deque[T] = deque(maxlen=None if max_len == -1 else max_len)

    @property
    def enabled(self) -> bool:
        return self.max_len != 0

    def append(self, item: T) -> None:
        if self.max_len != 0:
            self._items.append(item)

    def drain(self) -> list[T]:
        """Remove and return everything buffered now, oldest first."""
        drained: list[T] = []
        while True:
            try:
                drained.append(self._items.popleft())
            except IndexError:
                return drained

    def __len__(self) -> int:
        return len(self._items)
