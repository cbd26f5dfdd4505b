"""The ``kvcache`` section's own rules (cluster/config/kv_cache.py): sizing, pool ratio, the host
tier, SWA scratch reuse, and that one request fits."""

from __future__ import annotations

from cluster.config import KVCacheConfig, config_from_dict
from tests.cluster.conftest import issues_of


def test_kvcache_sizing_rules() -> None:
    assert KVCacheConfig(cpu_bytes="64MiB").cpu_bytes == 64 * 2**20  # type: ignore[arg-type]
    assert KVCacheConfig(num_pages=10).num_pages == 10  # default budgets do not conflict
    assert issues_of({"kvcache": {"num_pages": 10, "cpu_bytes": 1024}}) == [
        "kvcache.cpu_bytes: not allowed together with num_pages (pick one sizing)"
    ]
    assert issues_of({"kvcache": {"page_size": 12, "gpu_memory_fraction": 1.5}}) == [
        "kvcache.page_size: must be a power of two from 1 to 1024, got 12",
        "kvcache.gpu_memory_fraction: must be <= 1, got 1.5",
    ]
    assert KVCacheConfig(page_size=16, max_tokens=33).max_pages == 4  # 3 pages + the null page
    assert KVCacheConfig().max_pages is None


def test_kvcache_pool_ratio() -> None:
    ratio = {"full": 3.0, "swa_32": 1.0}
    assert config_from_dict({"kvcache": {"pool_ratio": ratio}}).kvcache.pool_ratio == ratio
    assert issues_of({"kvcache": {"pool_ratio": {"full": 0}}}) == [
        "kvcache.pool_ratio: shares must be > 0, got <= 0 for ['full']"
    ]
    assert issues_of({"kvcache": {"pool_ratio": {}}}) == [
        "kvcache.pool_ratio: must name at least one pool group, or be left out"
    ]
    assert issues_of({"kvcache": {"num_pages": 10, "pool_ratio": {"full": 1}}}) == [
        "kvcache.pool_ratio: splits a memory budget; with num_pages every group gets num_pages "
        "pages (pick one sizing)"
    ]
    assert issues_of({"kvcache": {"num_pages": 10, "max_tokens": 64}}) == [
        "kvcache.max_tokens: caps a memory budget; with num_pages it would not apply"
    ]


def test_kvcache_host_tier_bytes() -> None:
    """kvcache.host_tier_bytes: bytes or a unit; >= 0; needs prefix reuse (below one page per
    group is refused at worker start-up: tests/worker_common/test_engine_setup.py); not with
    tensor-parallel workers yet."""
    assert KVCacheConfig().host_tier_bytes == 0
    assert KVCacheConfig(host_tier_bytes="1GiB").host_tier_bytes == 2**30  # type: ignore[arg-type]
    assert issues_of({"kvcache": {"host_tier_bytes": -1}}) == [
        "kvcache.host_tier_bytes: must be a byte count (an integer, or a number with a unit like "
        "'512MiB'), got -1"
    ]
    assert issues_of({"kvcache": {"host_tier_bytes": "1GiB", "reuse_policy": "none"}}) == [
        "kvcache.host_tier_bytes: needs prefix reuse (with reuse_policy 'none' no page is ever "
        "reusable, so nothing would go to the host tier): set reuse_policy, or 0"
    ]
    tp = {"tensor_parallel_size": 2}
    assert issues_of({"kvcache": {"host_tier_bytes": "1GiB"}, "decode": tp, "prefill": tp}) == [
        "kvcache.host_tier_bytes: not supported with tensor parallelism yet (ranks 1.. hold their "
        "KV heads in processes the host tier does not copy): decode.tensor_parallel_size 2, "
        "prefill.tensor_parallel_size 2; use 0"
    ]
    aggregated = {"prefill": {"replicas": 0, **tp}, "kvcache": {"host_tier_bytes": "1GiB"}}
    assert config_from_dict(aggregated).kvcache.host_tier_bytes == 2**30  # no prefill workers


def test_kvcache_swa_scratch_reuse() -> None:
    assert KVCacheConfig().swa_scratch_reuse is False
    assert KVCacheConfig(swa_scratch_reuse=True).swa_scratch_reuse is True
    assert issues_of({"kvcache": {"swa_scratch_reuse": "sometimes"}})


def test_whether_one_request_fits_is_left_to_the_preflight() -> None:
    """It depends on the model's sliding windows (tests/cluster/test_preflight.py)."""
    config = config_from_dict({"model": {"max_model_len": 100}, "kvcache": {"num_pages": 3}})
    assert (config.kvcache.num_pages, config.model.max_model_len) == (3, 100)
