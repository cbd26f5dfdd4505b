"""From the cluster config to one worker's engine: the translation both worker roles share."""

from __future__ import annotations

from cluster.config import ClusterConfig
from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine


def engine_config_for(config: ClusterConfig, role: str) -> EngineConfig:
    """The EngineConfig of a prefill or decode worker of ``config``."""
    pool = config.prefill if role == "prefill" else config.decode
    on_gpu = pool.resources.num_gpus > 0
    kv = config.kvcache
    dummy = (
        config.model.dummy_config.as_hf_dict() if config.model.dummy_config is not None else None
    )
    return EngineConfig(
        model=config.model.source,
        load_format=config.model.load_format,
        dtype=config.model.dtype,
        device="cuda" if on_gpu else "cpu",
        page_size=kv.page_size,
        num_pages=kv.num_pages,
        kv_cache_memory_bytes=None if (on_gpu or kv.num_pages is not None) else int(kv.cpu_bytes),
        gpu_memory_fraction=kv.gpu_memory_fraction,
        kv_max_tokens=kv.max_tokens,
        max_num_seqs=pool.scheduler.max_num_seqs,
        max_num_batched_tokens=pool.scheduler.max_num_batched_tokens,
        prefill_chunk_size=pool.scheduler.prefill_chunk_size,
        max_model_len=config.model.max_model_len,
        reuse_policy=kv.reuse_policy,
        seed=config.model.seed,
        dummy_config=dummy,
        max_stats_len=config.stats.max_stats_len,
    )


def build_engine(config: ClusterConfig, role: str) -> LLMEngine:
    return LLMEngine.from_config(engine_config_for(config, role))
