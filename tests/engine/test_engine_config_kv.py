"""The KV sizing fields of EngineConfig reach the pool (CPU budget, token cap) and bad ones are refused."""

from __future__ import annotations

import pytest

from engine.engine_config import EngineConfig
from engine.kv_setup import build_kv_cache, kv_pool_templates
from engine.model_config import ModelConfig
from tests.tiny_engine import TINY as TINY_HF

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
