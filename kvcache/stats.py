"""KV cache statistics: plain dataclasses of ints, safe to ship across actor boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolGroupStats:
    """Page counts of one pool group (all in pages; the null page is never counted).

    ``free`` is what an allocation may take: plain free pages plus ``evictable`` ones (cached pages
    nobody holds), so ``free + used == total``; ``plain_free = free - evictable``.

    Interval peaks, since the last ``KVCacheManager.reset_peak()`` (call it once per stats
    interval): ``peak_used`` is the most pages held at once, ``peak_evictable`` the most cached
    pages nobody held at once, and ``free_low_water`` the fewest plain free pages at once (0: the
    interval ran out of plain free pages and evicted cached ones, or came close).
    """

    total: int
    free: int
    used: int
    evictable: int
    peak_used: int
    evictions: int  # cached pages dropped from the index to make room, since construction
    peak_evictable: int
    free_low_water: int
    sliding_window: int | None = None  # the group's window in tokens; None for full attention

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0

    @property
    def plain_free(self) -> int:
        """Pages neither held nor cached."""
        return self.free - self.evictable


@dataclass
class ReuseCounters:
    """Prefix-reuse counters (in tokens), counted once per admitted request.

    A query is counted when a ``PrefixMatch`` is consumed by a request's first ``allocate_slots``;
    ``miss_tokens`` is the looked-up length minus the hit.
    """

    queries: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0

    def record(self, hit_tokens: int, query_tokens: int) -> None:
        self.queries += 1
        self.hit_tokens += hit_tokens
        self.miss_tokens += query_tokens - hit_tokens


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a KV cache manager."""

    groups: dict[str, PoolGroupStats] = field(default_factory=dict)
    reuse_queries: int = 0
    reuse_hit_tokens: int = 0
    reuse_miss_tokens: int = 0
    host_drops: int = 0  # reusable pages dropped from the host tier before reuse (no host tier yet)
    num_requests: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the cache."""
        total = self.reuse_hit_tokens + self.reuse_miss_tokens
        return self.reuse_hit_tokens / total if total else 0.0
