"""A worker's KV cache on /metrics: the pages of each pool group by tier and state, their peaks
in the last stats interval, the prefix cache's lookups and hits by medium, and the host tier's
traffic. Per pool group metrics carry ``group`` (the KV pool group: "full", "swa_<window>") and
``medium``: "device" (the worker's KV pool) or "host" (the KV host tier beneath it,
``kvcache.host_tier_bytes``). The counters come as the worker's running totals; the difference to
the previous total is added (cluster/prom_metrics.py: the rest of /metrics, and who calls this).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvcache.stats import KVCacheStats

PREFIX = "duet:"

WorkerLabels = tuple[str, str, str]  # (model name, role, worker id)


@dataclass
class WorkerKVSeries:
    """What the metrics keep of one worker's KV stats between two of its updates."""

    # Label tails (after model, role, worker) of each per-group gauge this worker set.
    group_series: dict[Gauge, set[tuple[str, ...]]] = field(default_factory=dict)
    # The worker's last running total of each KV counter series (metric, label tail).
    totals: dict[tuple[Counter, tuple[str, ...]], int] = field(default_factory=dict)


class KVCacheMetrics:
    """Every worker's KV cache metrics, in ``registry``; ``worker``: the label names of a worker
    (model name, role, worker id), which the per-group labels follow."""

    def __init__(self, registry: CollectorRegistry, worker: list[str]) -> None:
        group = [*worker, "group", "medium"]

        def gauge(name: str, doc: str, labels: list[str]) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        self.kv_group_pages = gauge(
            "kv_cache_pages",
            "Pages of a KV pool group by state: used (held by requests), free (what an allocation "
            "may take, evictable ones included), evictable (cached, held by nobody).",
            [*group, "state"],
        )
        self.kv_group_peak_pages = gauge(
            "kv_cache_peak_pages",
            "Most pages of a KV pool group in a state at once during the worker's last complete "
            "stats interval (stats.interval_s): used, evictable.",
            [*group, "state"],
        )
        self.kv_group_free_low_water = gauge(
            "kv_cache_free_low_water_pages",
            "Fewest plain free pages (neither held nor cached) of a KV pool group at once during "
            "the last complete stats interval; 0: it evicted cached pages or came close.",
            group,
        )
        self.kv_group_window = gauge(
            "kv_cache_sliding_window_tokens",
            "The attention window of a sliding-window KV pool group, in tokens (full-attention "
            "groups have none).",
            [*worker, "group"],
        )

        def kv_counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.prefix_queries = kv_counter(
            "prefix_cache_queries_total",
            "Prompt tokens looked up in a worker's prefix cache (once per admitted request).",
            worker,
        )
        self.prefix_hits = kv_counter(
            "prefix_cache_hits_total",
            "Prompt tokens found in a worker's prefix cache, by where: its KV pool (device) or "
            "its host tier (loaded back).",
            [*worker, "medium"],
        )
        self.kv_offloaded = kv_counter(
            "kv_offloaded_pages_total",
            "Reusable pages a pool group evicted and copied into the host tier.",
            group,
        )
        self.kv_loaded_back = kv_counter(
            "kv_loaded_back_pages_total",
            "Host-tier pages copied back into a pool group for a prefix hit.",
            group,
        )
        self.kv_host_hits = kv_counter(
            "kv_host_hit_tokens_total",
            "Prompt tokens a pool group served from the host tier (loaded back).",
            group,
        )
        self.kv_host_drops = kv_counter(
            "kv_host_drops_total",
            "Pages dropped from the host tier to make room before any prefix hit reused them.",
            group,
        )
        self.kv_skipped_stores = kv_counter(
            "kv_skipped_stores_total",
            "Evicted reusable pages not stored in the host tier: every host page was being read "
            "by a load-back.",
            group,
        )

        self._series: dict[tuple[str, str], WorkerKVSeries] = {}  # by (role, worker id)
        self._lock = threading.Lock()  # stats pollers may run on several threads

    def set(self, labels: WorkerLabels, kv: KVCacheStats, interval: KVCacheStats | None) -> None:
        """One worker's KV stats: ``kv`` now (per pool group and tier; its counters are running
        totals), ``interval`` at the end of its last complete stats interval (its peaks), None
        before the first."""
        values: list[tuple[Gauge, tuple[str, ...], float]] = []
        totals: list[tuple[Counter, tuple[str, ...], int]] = [
            (self.prefix_queries, (), kv.reuse_hit_tokens + kv.reuse_miss_tokens),
            (self.prefix_hits, ("device",), kv.reuse_hit_tokens - kv.reuse_host_hit_tokens),
        ]
        if any(g.host is not None for g in kv.groups.values()):
            totals.append((self.prefix_hits, ("host",), kv.reuse_host_hit_tokens))
        for name, g in kv.groups.items():
            for state, n in (("used", g.used), ("free", g.free), ("evictable", g.evictable)):
                values.append((self.kv_group_pages, (name, "device", state), n))
            if g.sliding_window is not None:
                values.append((self.kv_group_window, (name,), g.sliding_window))
            h = g.host
            if h is None:
                continue
            for state, n in (("used", h.used), ("free", h.free), ("pinned", h.pinned)):
                values.append((self.kv_group_pages, (name, "host", state), n))
            for counter, total in (
                (self.kv_offloaded, h.offloaded),
                (self.kv_loaded_back, h.loaded_back),
                (self.kv_host_hits, h.hit_tokens),
                (self.kv_host_drops, h.drops),
                (self.kv_skipped_stores, h.skipped_stores),
            ):
                totals.append((counter, (name, "host"), total))
        for name, g in (interval.groups if interval is not None else {}).items():
            for state, n in (("used", g.peak_used), ("evictable", g.peak_evictable)):
                values.append((self.kv_group_peak_pages, (name, "device", state), n))
            values.append((self.kv_group_free_low_water, (name, "device"), g.free_low_water))
        with self._lock:
            series = self._series.setdefault(labels[1:], WorkerKVSeries())
            for gauge, tail, value in values:
                gauge.labels(*labels, *tail).set(value)
                series.group_series.setdefault(gauge, set()).add(tail)
            increments = []
            for counter, tail, total in totals:
                previous = series.totals.get((counter, tail), 0)
                series.totals[(counter, tail)] = total
                increments.append((counter, tail, running_delta(previous, total)))
        for counter, tail, increment in increments:
            counter.labels(*labels, *tail).inc(increment)

    def restarted(self, labels: WorkerLabels) -> None:
        """The worker's process restarted: its running totals count from zero again."""
        with self._lock:
            series = self._series.get(labels[1:])
            if series is not None:
                series.totals.clear()

    def hide(self, labels: WorkerLabels) -> None:
        """Stop exporting the worker's per-group gauges (it is down) until its next ``set``;
        counters stay: their totals are history, and Prometheus handles a series that stops."""
        with self._lock:
            series = self._series.get(labels[1:])
            group_gauges = (
                self.kv_group_pages,
                self.kv_group_peak_pages,
                self.kv_group_free_low_water,
                self.kv_group_window,
            )
            for gauge in group_gauges:
                for tail in series.group_series.get(gauge, ()) if series else ():
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels, *tail)

    def forget(self, labels: WorkerLabels) -> None:
        """Forget a worker that left the cluster (``hide`` it first)."""
        with self._lock:
            self._series.pop(labels[1:], None)


def running_delta(previous_total: int, total: int) -> int:
    """What a running total added since ``previous_total``: all of it when it went down (the
    worker restarted)."""
    return total - previous_total if total >= previous_total else total
