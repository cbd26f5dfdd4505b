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


def test_free_pages_are_the_fullest_group_s() -> None:
    """A request needs pages in every group: a worker's room is its fullest group's free pages,
    not a sum over groups of different sizes. The router prefers the decode worker with the most
    (cluster/worker_choice.py); by the sum it picked one with its window group full, where the
    request then waited for pages."""
    import torch

    from cluster.worker_choice import WorkerChoice, WorkerSlot
    from decode_worker.receive_plan import plan_receive
    from kvcache.manager import KVCacheManager
    from kvcache.spec import PoolGroupSpec

    def hybrid() -> KVCacheManager:  # the window group smaller, as the sizing makes it
        return KVCacheManager(
            [
                PoolGroupSpec("full", (0,), 41, 4, 1, 1, torch.float32),
                PoolGroupSpec("swa_8", (1,), 13, 4, 1, 1, torch.float32, sliding_window=8),
            ],
            "all_reusable",
            "cpu",
        )

    short, long = hybrid(), hybrid()
    for i in range(4):  # four short requests fill the window group
        assert short.allocate_slots(f"s{i}", 12, short.match_prefix([100 + i] * 12), 0)
    held = list(range(200, 320))  # one long one holds most of the full group
    assert long.allocate_slots("long", 120, long.match_prefix(held), num_computed_tokens=117)
    assert (short.stats().free, long.stats().free) == (0, 10)
    assert sum(short.num_free_pages(g) for g in short.specs) == 28  # (what was reported)
    slots = [WorkerSlot(name, None, free_pages=kv.stats().free)
             for name, kv in (("short", short), ("long", long))]  # fmt: skip
    assert WorkerChoice([], slots, "load_balance", 4, None, 0).pick_decode().worker_id == "long"
    assert plan_receive(long, "r", list(range(500, 520))) is not None
    assert plan_receive(short, "r", list(range(500, 520))) is None  # no room there
    assert KVCacheStats().free == 0
