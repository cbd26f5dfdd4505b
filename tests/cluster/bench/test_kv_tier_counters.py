"""A run's KV host-tier figures from a Duet server's /metrics text (the real exporter's), and the
report's table of them."""

from __future__ import annotations

from cluster.bench.kv_tier_counters import kv_tier_fields, parse_kv_tier_totals
from cluster.bench.report import kv_tier_table
from cluster.prom_metrics import ServingMetrics
from kvcache.stats import HostTierStats, KVCacheStats, PoolGroupStats


def group(host: HostTierStats | None) -> PoolGroupStats:
    return PoolGroupStats(
        total=10, free=7, used=3, evictable=2, peak_used=5, evictions=0, peak_evictable=4,
        free_low_water=1, host=host,
    )  # fmt: skip


def host(offloaded: int, loaded_back: int, hit_tokens: int, drops: int) -> HostTierStats:
    return HostTierStats(
        total=8, used=5, free=3, pinned=0, offloaded=offloaded, loaded_back=loaded_back,
        hit_tokens=hit_tokens, drops=drops, skipped_stores=1,
    )  # fmt: skip


def render(metrics: ServingMetrics) -> str:
    return metrics.render().decode()


def test_a_runs_figures_are_the_differences_summed_over_workers_per_group() -> None:
    metrics = ServingMetrics("m")
    metrics.set_worker_stats(
        "p0", "prefill", 0, 0, 0.1, kv=KVCacheStats({"full": group(host(4, 1, 16, 0))})
    )
    both = {"full": group(host(2, 0, 0, 0)), "swa_8": group(host(3, 3, 48, 1))}
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.1, kv=KVCacheStats(both))
    before = parse_kv_tier_totals(render(metrics))
    assert before == {
        "offloaded_pages": {"full": 6, "swa_8": 3},
        "loaded_back_pages": {"full": 1, "swa_8": 3},
        "host_hit_tokens": {"full": 16, "swa_8": 48},
        "host_drops": {"full": 0, "swa_8": 1},
        "skipped_stores": {"full": 2, "swa_8": 1},
    }
    metrics.set_worker_stats(
        "p0", "prefill", 0, 0, 0.1, kv=KVCacheStats({"full": group(host(10, 4, 64, 2))})
    )
    fields = kv_tier_fields(before, parse_kv_tier_totals(render(metrics)))
    assert fields["kv_host_offloaded_pages"] == 6
    assert fields["kv_host_loaded_back_pages"] == 3
    assert fields["kv_host_host_hit_tokens"] == 48
    assert fields["kv_host_host_drops"] == 2
    assert fields["kv_host_skipped_stores"] == 0
    assert fields["kv_host_by_group"] == {
        "full": dict(offloaded_pages=6, loaded_back_pages=3, host_hit_tokens=48, host_drops=2,
                     skipped_stores=0),
        "swa_8": dict(offloaded_pages=0, loaded_back_pages=0, host_hit_tokens=0, host_drops=0,
                      skipped_stores=0),
    }  # fmt: skip
    table = kv_tier_table({"runs": [{"request_rate": 2.0, **fields}]})
    assert table is not None
    assert table.splitlines()[-1].split() == ["2", "6", "3", "48", "2", "0"]


def test_without_a_host_tier_nothing_is_reported() -> None:
    metrics = ServingMetrics("m")
    metrics.set_worker_stats("d0", "decode", 0, 0, 0.1, kv=KVCacheStats({"full": group(None)}))
    assert parse_kv_tier_totals(render(metrics)) is None
    assert kv_tier_fields(None, None) == {}
    assert kv_tier_table({"runs": [{"request_rate": 1.0}]}) is None
