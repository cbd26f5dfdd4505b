"""The KV sizing fields of EngineConfig reach the pools (CPU budget, token cap, pool ratio, scratch
reuse; one group per window) and bad ones are refused."""

from __future__ import annotations

import logging

import pytest

from engine.engine_config import EngineConfig
from engine.kv_setup import build_kv_cache, kv_pool_templates
from engine.model_config import ModelConfig
from kvcache.sizing import KVSizingError
from tests.tiny_engine import TINY as TINY_HF

from .conftest import HYBRID_HF_CONFIGS

TINY = ModelConfig.from_hf_config(TINY_HF)


def test_kv_max_tokens_caps_the_pool() -> None:
    big = EngineConfig(kv_cache_memory_bytes=64 << 20, max_num_seqs=8, page_size=16)
    capped = EngineConfig(
        kv_cache_memory_bytes=64 << 20, max_num_seqs=8, page_size=16, kv_max_tokens=160
    )
    uncapped = build_kv_cache(TINY, big, 256).specs["full"].usable_pages
    assert uncapped == 8 * 256 // 16  # max_num_seqs sequences of max_model_len tokens
    assert build_kv_cache(TINY, capped, 128).specs["full"].usable_pages == 160 // 16


def test_cpu_budget_sets_the_page_count() -> None:
    (template,) = kv_pool_templates(TINY, 16, EngineConfig().torch_dtype)
    page_bytes = template.page_bytes
    cfg = EngineConfig(kv_cache_memory_bytes=20 * page_bytes, max_num_seqs=64, page_size=16)
    assert build_kv_cache(TINY, cfg, 256).specs["full"].num_pages == 20  # the null page counts


@pytest.mark.parametrize(
    ("field", "value"),
    [("gpu_memory_fraction", 0.0), ("gpu_memory_fraction", 1.5), ("kv_max_tokens", 0)],
)
def test_bad_kv_fields_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_host_tier_with_tensor_parallelism_is_refused() -> None:
    """Ranks 1.. hold their KV heads in processes of their own, which the host tier (rank 0's
    manager) does not copy: asking for both is an error, never a tier that loads back only rank
    0's heads."""
    with pytest.raises(ValueError, match=r"host_tier_bytes is not supported with tensor_parallel"):
        EngineConfig(host_tier_bytes=1 << 20, tensor_parallel_size=2)
    assert EngineConfig(host_tier_bytes=1 << 20).tensor_parallel_size == 1


GEMMA = ModelConfig.from_hf_config(HYBRID_HF_CONFIGS["gemma3"])  # 5 sliding (window 32) : 1 full


def test_one_pool_group_per_window() -> None:
    full, window = kv_pool_templates(GEMMA, 8, EngineConfig().torch_dtype)
    assert (full.name, full.layer_ids, full.sliding_window) == ("full", (5,), None)
    assert (window.name, window.layer_ids, window.sliding_window) == ("swa_32", (0, 1, 2, 3, 4), 32)


def test_budget_splits_by_what_one_request_holds(caplog: pytest.LogCaptureFixture) -> None:
    full, window = kv_pool_templates(GEMMA, 8, EngineConfig().torch_dtype)
    # one request of 256 tokens: 32 full pages; 7 + 24 - 2 tokens of window span -> 8 pages
    budget = 4 * (32 * full.page_bytes + 8 * window.page_bytes)
    cfg = EngineConfig(kv_cache_memory_bytes=budget, page_size=8, prefill_chunk_size=24)
    with caplog.at_level(logging.INFO, logger="engine.kv_setup"):
        kv = build_kv_cache(GEMMA, cfg, 256)
    assert {g: s.num_pages for g, s in kv.specs.items()} == {"full": 128, "swa_32": 32}
    assert "full 127 pages" in caplog.text and "swa_32 31 pages" in caplog.text
    ratio = EngineConfig(
        kv_cache_memory_bytes=budget, page_size=8, prefill_chunk_size=24,
        pool_ratio={"full": 1, "swa_32": 1},
    )  # fmt: skip
    kv = build_kv_cache(GEMMA, ratio, 256)
    assert kv.specs["full"].num_pages * full.page_bytes == budget // 2
    assert kv.specs["swa_32"].num_pages == budget // 2 // window.page_bytes


def test_pool_ratio_naming_a_missing_group_lists_the_models_groups() -> None:
    cfg = EngineConfig(kv_cache_memory_bytes=1 << 24, pool_ratio={"full": 1, "swa_4096": 1})
    with pytest.raises(KVSizingError, match=r"\['swa_4096'\].*\['full', 'swa_32'\]") as e:
        build_kv_cache(GEMMA, cfg, 256)
    assert e.value.setting == "pool_ratio"
    with pytest.raises(ValueError, match="pool_ratio splits a memory budget"):
        EngineConfig(num_pages=10, pool_ratio={"full": 1})
    # Every budget is refused beside num_pages, never ignored.
    for sizing in ({"kv_cache_memory_bytes": 1 << 24}, {"kv_max_tokens": 32}):
        with pytest.raises(ValueError, match=f"{next(iter(sizing))} sizes the KV pools"):
            EngineConfig(num_pages=10, **sizing)
    with pytest.raises(ValueError, match=r"pool_ratio shares must be > 0, got <= 0 for \['full'\]"):
        EngineConfig(pool_ratio={"full": 0})


def test_a_group_too_small_for_one_request_refuses_to_start() -> None:
    cfg = EngineConfig(
        kv_cache_memory_bytes=1 << 24,
        page_size=8,
        prefill_chunk_size=24,
        pool_ratio={"full": 300, "swa_32": 1},  # 1/301 of 16 MiB: 5 pages of 10 KiB
    )
    with pytest.raises(
        KVSizingError, match="group 'swa_32' has 4 usable pages, one request needs 8"
    ):
        build_kv_cache(GEMMA, cfg, 256)


def test_scratch_reuse_reaches_the_manager() -> None:
    cfg = EngineConfig(num_pages=64, page_size=8, swa_scratch_reuse=True)
    assert build_kv_cache(GEMMA, cfg, 256).swa_scratch_reuse
    with pytest.raises(ValueError, match="swa_scratch_reuse must be a bool"):
        EngineConfig(swa_scratch_reuse="yes")  # type: ignore[arg-type]


def test_a_step_budget_under_max_num_seqs_is_refused() -> None:
    """As vLLM refuses it: the running requests past the budget would get no token in a step."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs"):
        EngineConfig(max_num_batched_tokens=32, prefill_chunk_size=32)  # (max_num_seqs 256)
    EngineConfig(max_num_batched_tokens=32, prefill_chunk_size=32, max_num_seqs=32)
