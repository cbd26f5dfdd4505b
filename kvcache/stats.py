"""KV cache statistics per pool group and tier: plain dataclasses of ints, safe to ship across
actor boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostTierStats:
    """The host tier beneath one pool group (kvcache/host_tier.py). Pages now, and running totals
    since construction.

    ``used`` pages hold a stored page's KV (findable by hash), ``pinned`` of them are being read by
    load-backs; ``free`` pages hold nothing. ``offloaded``: device pages copied here on eviction;
    ``loaded_back``: pages copied back to the device for a prefix hit (``hit_tokens`` = those pages'
    tokens); ``drops``: stored pages dropped (to make room) before they were ever loaded back;
    ``skipped_stores``: device evictions that could not be stored because every host page was
    pinned by a load-back.
    """

    total: int
    used: int
    free: int
    pinned: int
    offloaded: int
    loaded_back: int
    hit_tokens: int
    drops: int
    skipped_stores: int


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
    host: HostTierStats | None = None  # the host tier beneath the group; None without one

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
    ``miss_tokens`` is the looked-up length minus the hit; ``host_hit_tokens`` the part of the hit
    loaded back from the host tier (``PrefixMatch.host_tokens_taken``: of a decode worker's
    allocation, which starts past the hit, fewer than ``PrefixMatch.num_host_tokens``).
    """

    queries: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    host_hit_tokens: int = 0

    def record(self, hit_tokens: int, query_tokens: int, host_hit_tokens: int = 0) -> None:
        self.queries += 1
        self.hit_tokens += hit_tokens
        self.miss_tokens += query_tokens - hit_tokens
        self.host_hit_tokens += host_hit_tokens


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a KV cache manager. ``reuse_hit_tokens`` counts hits on either tier, of
    which ``reuse_host_hit_tokens`` came from the host tier. ``peak_used``: the most device pages
    held in all groups together at once since the last ``reset_peak()``; at most the sum of the
    groups' own ``peak_used``, which peak at different moments."""

    groups: dict[str, PoolGroupStats] = field(default_factory=dict)
    reuse_queries: int = 0
    reuse_hit_tokens: int = 0
    reuse_miss_tokens: int = 0
    num_requests: int = 0
    reuse_host_hit_tokens: int = 0
    peak_used: int = 0

    @property
    def total(self) -> int:
        """Device pages of every group."""
        return sum(g.total for g in self.groups.values())

    @property
    def usage(self) -> float:
        """The fullest group's share of its device pages held now (1 = full). Each group is a
        pool of its own and a request needs pages in every one, so the fullest decides what fits
        (all groups' pages together read 0.1 with a window group full and nothing admitted)."""
        return max((g.usage for g in self.groups.values()), default=0.0)

    @property
    def free(self) -> int:
        """Free pages (evictable ones too) of the fullest group: the room a worker has for new
        requests, which need pages in every group (a sum over groups read 28 on a worker with
        28 pages free in its full-attention group and none in its window group, above another's
        10 + 9, and the router sent the request where it waited for pages)."""
        groups = [g for g in self.groups.values() if g.total]
        return min(groups, key=lambda g: (g.free / g.total, g.free)).free if groups else 0

    @property
    def peak_usage(self) -> float:
        """The most of ``usage`` during the interval: the fullest group's own peak share (the
        peak of a maximum is the maximum of the peaks)."""
        return max((g.peak_used / g.total for g in self.groups.values() if g.total), default=0.0)

    @property
    def host_drops(self) -> int:
        """Pages dropped from the host tier before they were reused from there, every group."""
        return sum(g.host.drops for g in self.groups.values() if g.host is not None)

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the cache."""
        total = self.reuse_hit_tokens + self.reuse_miss_tokens
        return self.reuse_hit_tokens / total if total else 0.0
