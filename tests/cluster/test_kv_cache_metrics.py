"""A worker's KV cache on /metrics (cluster/kv_cache_metrics.py), as ServingMetrics renders it:
per pool group and tier, running totals as counters, series hidden and forgotten with the worker."""

from __future__ import annotations

from cluster.prom_metrics import ServingMetrics
from kvcache.stats import HostTierStats, KVCacheStats, PoolGroupStats
from tests.cluster.test_prom_metrics import MODEL, samples, value


def group_stats(**fields: int | None) -> PoolGroupStats:
    base: dict[str, int | None] = dict(
        total=10, free=7, used=3, evictable=2, peak_used=5, evictions=0, peak_evictable=4,
        free_low_water=1,
    )  # fmt: skip
    return PoolGroupStats(**{**base, **fields})  # type: ignore[arg-type]


def test_per_pool_group_gauges() -> None:
    """Each pool group of a hybrid worker gets its own series: pages by state now, the last
    interval's peaks and free low water, and a window group's window."""
    metrics = ServingMetrics(MODEL)
    now = {"full": group_stats(), "swa_32": group_stats(used=6, free=4, sliding_window=32)}
    metrics.set_worker_stats("d0", "decode", 0, 1, 0.3, kv=KVCacheStats(now))
    d0 = {"role": "decode", "worker": "d0"}
    full, swa = {**d0, "group": "full", "medium": "device"}, {**d0, "group": "swa_32"}
    assert value(metrics, "duet:kv_cache_pages", **full, state="used") == 3
    assert value(metrics, "duet:kv_cache_pages", **full, state="free") == 7
    assert value(metrics, "duet:kv_cache_pages", **full, state="evictable") == 2
    assert value(metrics, "duet:kv_cache_pages", **swa, medium="device", state="used") == 6
    assert value(metrics, "duet:kv_cache_sliding_window_tokens", **swa) == 32
    names = {name for name, _ in samples(metrics)}
    assert "duet:kv_cache_sliding_window_tokens" in names
    assert not {"duet:kv_cache_peak_pages", "duet:kv_cache_free_low_water_pages"} & names
    windows = [dict(labels)["group"] for name, labels in samples(metrics) if "window" in name]
    assert windows == ["swa_32"]  # a full-attention group has no window

    swa_interval = group_stats(peak_used=9, peak_evictable=0, free_low_water=0, sliding_window=32)
    interval = {"full": group_stats(), "swa_32": swa_interval}
    metrics.set_worker_stats(
        "d0", "decode", 0, 1, 0.3, kv=KVCacheStats(now), kv_interval=KVCacheStats(interval)
    )
    swa_device = {**swa, "medium": "device"}
    assert value(metrics, "duet:kv_cache_peak_pages", **full, state="used") == 5
    assert value(metrics, "duet:kv_cache_peak_pages", **full, state="evictable") == 4
    assert value(metrics, "duet:kv_cache_peak_pages", **swa_device, state="used") == 9
    assert value(metrics, "duet:kv_cache_free_low_water_pages", **full) == 1
    assert value(metrics, "duet:kv_cache_free_low_water_pages", **swa_device) == 0

    metrics.remove_worker("d0", "decode")
    left = [n for n, labels in samples(metrics) if ("worker", "d0") in labels and "kv_cache" in n]
    assert left == []


def host_stats(**fields: int) -> HostTierStats:
    base = dict(
        total=8, used=5, free=3, pinned=1, offloaded=6, loaded_back=2, hit_tokens=32, drops=1,
        skipped_stores=0,
    )  # fmt: skip
    return HostTierStats(**{**base, **fields})


def test_host_tier_and_prefix_hits_by_medium() -> None:
    """The host tier under each group: pages by state (medium "host"), and its running totals as
    counters that add the difference; prefix-cache queries and hits by medium."""
    metrics = ServingMetrics(MODEL)
    kv = KVCacheStats(
        {"full": group_stats(host=host_stats())},
        reuse_hit_tokens=100,
        reuse_miss_tokens=60,
        reuse_host_hit_tokens=32,
    )
    metrics.set_worker_stats("p0", "prefill", 0, 0, 0.3, kv=kv)
    p0 = {"role": "prefill", "worker": "p0"}
    host = {**p0, "group": "full", "medium": "host"}
    assert value(metrics, "duet:kv_cache_pages", **host, state="used") == 5
    assert value(metrics, "duet:kv_cache_pages", **host, state="free") == 3
    assert value(metrics, "duet:kv_cache_pages", **host, state="pinned") == 1
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 6
    assert value(metrics, "duet:kv_loaded_back_pages_total", **host) == 2
    assert value(metrics, "duet:kv_host_hit_tokens_total", **host) == 32
    assert value(metrics, "duet:kv_host_drops_total", **host) == 1
    assert value(metrics, "duet:kv_skipped_stores_total", **host) == 0
    assert value(metrics, "duet:prefix_cache_queries_total", **p0) == 160
    assert value(metrics, "duet:prefix_cache_hits_total", **p0, medium="device") == 68
    assert value(metrics, "duet:prefix_cache_hits_total", **p0, medium="host") == 32
    later = KVCacheStats(
        {"full": group_stats(host=host_stats(offloaded=9, drops=4))},
        reuse_hit_tokens=100,
        reuse_miss_tokens=70,
        reuse_host_hit_tokens=32,
    )
    metrics.set_worker_stats("p0", "prefill", 0, 0, 0.3, kv=later)
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 9
    assert value(metrics, "duet:kv_host_drops_total", **host) == 4
    assert value(metrics, "duet:prefix_cache_queries_total", **p0) == 170
    no_tier = KVCacheStats({"full": group_stats()})
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.3, kv=no_tier)
    hosts = [labels for n, labels in samples(metrics) if ("medium", "host") in labels]
    assert all(("worker", "p0") in labels for labels in hosts)  # no host series without a tier


def test_a_restarted_or_hidden_worker_and_its_kv_series() -> None:
    """Another process id restarts the KV counters' running totals from zero (what they add is
    counted on); a hidden worker shows no per-group gauges until it reports again."""
    metrics = ServingMetrics(MODEL)
    kv = KVCacheStats({"full": group_stats(host=host_stats())})
    metrics.set_worker_stats("p0", "prefill", 0, 0, 0.3, kv=kv, pid=1)
    host = {"role": "prefill", "worker": "p0", "group": "full", "medium": "host"}
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 6
    again = KVCacheStats({"full": group_stats(host=host_stats(offloaded=2))})
    metrics.set_worker_stats("p0", "prefill", 0, 0, 0.3, kv=again, pid=2)
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 8
    metrics.hide_worker("p0", "prefill")
    assert not [n for n, labels in samples(metrics) if n == "duet:kv_cache_pages"]
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 8  # (history stays)
    metrics.set_worker_stats("p0", "prefill", 0, 0, 0.3, kv=again, pid=2)
    assert value(metrics, "duet:kv_cache_pages", **host, state="used") == 5
    assert value(metrics, "duet:kv_offloaded_pages_total", **host) == 8
