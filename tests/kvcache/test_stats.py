from kvcache.stats import HostTierStats, KVCacheStats, PoolGroupStats, ReuseCounters


def test_reuse_counters_record_hits_and_misses() -> None:
    c = ReuseCounters()
    c.record(hit_tokens=4, query_tokens=10)
    c.record(hit_tokens=0, query_tokens=3)
    assert (c.queries, c.hit_tokens, c.miss_tokens) == (2, 4, 9)


def test_hit_rate_and_usage() -> None:
    assert KVCacheStats().hit_rate == 0.0
    assert KVCacheStats(reuse_hit_tokens=1, reuse_miss_tokens=3).hit_rate == 0.25
    g = PoolGroupStats(
        total=8, free=6, used=2, evictable=1, peak_used=5, evictions=0, peak_evictable=3,
        free_low_water=1,
    )  # fmt: skip
    assert g.usage == 0.25 and g.plain_free == 5 and g.sliding_window is None


def test_host_drops_add_up_over_the_groups() -> None:
    def group(drops: int | None) -> PoolGroupStats:
        host = None
        if drops is not None:
            host = HostTierStats(
                total=4, used=3, free=1, pinned=0, offloaded=5, loaded_back=1, hit_tokens=2,
                drops=drops, skipped_stores=0,
            )  # fmt: skip
        return PoolGroupStats(8, 6, 2, 1, 5, 0, 3, 1, host=host)

    assert KVCacheStats({"full": group(None)}).host_drops == 0
    assert KVCacheStats({"full": group(2), "swa_8": group(3)}).host_drops == 5
