"""From the cluster config to each worker's WorkerSpec: everything a worker actor is built from.

The workers never see the cluster config: they get typed settings (EngineConfig,
TransceiverConfig, deadlines, stats) made here, in the server process, once.
"""

from __future__ import annotations

import logging
import struct

from cluster.config import ClusterConfig, ConfigError
from cluster.config.kv_cache import KVCacheConfig
from cluster.transfer_setup import transceiver_config
from engine.engine_config import EngineConfig
from worker_common.messages import Role, WorkerDeadlines, WorkerSpec


def shared_gpu_utilization(num_gpus: float, kv: KVCacheConfig) -> float | None:
    """A worker sharing its GPU (0 < num_gpus < 1) takes at most its share of the whole memory
    (times gpu_memory_fraction), sized as vLLM's gpu_memory_utilization: from free memory, the
    workers sizing at once each saw it all and together took more than there was. None: a
    GPU of its own (or none), sized from its free memory."""
    return kv.gpu_memory_fraction * num_gpus if 0 < num_gpus < 1 else None


def engine_config_for(config: ClusterConfig, role: Role) -> EngineConfig:
    """The EngineConfig of a prefill or decode worker of ``config`` (device "cuda" is resolved to
    the worker's own GPU on its node; dtype "auto" to the checkpoint's here, so that every worker
    gets the same one)."""
    pool = config.prefill if role is Role.PREFILL else config.decode
    on_gpu = pool.resources.num_gpus > 0
    kv = config.kvcache
    dummy = (
        config.model.dummy_config.as_hf_dict() if config.model.dummy_config is not None else None
    )
    engine = EngineConfig(
        model=config.model.worker_source,
        load_format=config.model.load_format,
        dtype=config.model.dtype,
        device="cuda" if on_gpu else "cpu",
        page_size=kv.page_size,
        num_pages=kv.num_pages,
        kv_cache_memory_bytes=None if (on_gpu or kv.num_pages is not None) else int(kv.cpu_bytes),
        gpu_memory_fraction=kv.gpu_memory_fraction,
        gpu_memory_utilization=shared_gpu_utilization(pool.resources.num_gpus, kv),
        kv_max_tokens=kv.max_tokens,
        max_num_seqs=pool.scheduler.max_num_seqs,
        max_num_batched_tokens=pool.scheduler.max_num_batched_tokens,
        prefill_chunk_size=pool.scheduler.prefill_chunk_size,
        max_model_len=config.model.max_model_len,
        reuse_policy=kv.reuse_policy,
        pool_ratio=dict(kv.pool_ratio) if kv.pool_ratio is not None else None,
        swa_scratch_reuse=kv.swa_scratch_reuse,
        host_tier_bytes=int(kv.host_tier_bytes),
        seed=config.model.seed,
        dummy_config=dummy,
        max_stats_len=config.stats.max_stats_len,
        # The engine's request stats are the source of the per-request reports (/perf_metrics).
        max_request_stats_len=config.stats.perf_buffer_len,
        tensor_parallel_size=pool.tensor_parallel_size,
    )
    try:
        return engine.resolved()
    except (OSError, ValueError, struct.error) as e:  # (a missing or truncated checkpoint)
        raise ConfigError(
            "cluster config",
            [f"model.dtype: auto reads the checkpoint's dtype, and could not: {e}"],
        ) from None


def worker_spec(
    config: ClusterConfig,
    role: Role,
    index: int,
    collector_name: str | None,
    log_level: str | None = None,
    transfer_secret: str | None = None,
) -> WorkerSpec:
    """The spec of worker ``index`` of ``role``; ``collector_name`` is the perf-metrics collector
    actor (None when ``stats.perf_buffer_len`` is 0: the workers report nothing);
    ``transfer_secret`` the cluster's (None: ``cluster_secret(config)``, which raises when the
    config and the environment give none)."""
    transfer = None if config.aggregated else transceiver_config(config, transfer_secret)
    return WorkerSpec(
        worker_id=f"{role.value}-{index}",
        role=role,
        engine=engine_config_for(config, role),
        transceiver=transfer,
        transfer_interface=config.transfer.interface if transfer is not None else None,
        deadlines=WorkerDeadlines(
            prefill_s=config.prefill.prefill_deadline_s,
            page_wait_s=config.decode.page_wait_deadline_s,
            token_s=config.decode.token_deadline_s,
        ),
        stats_interval_s=config.stats.interval_s,
        publish_kv_events=config.router.uses_kv_events,
        collector_name=collector_name if config.stats.perf_buffer_len != 0 else None,
        log_level=log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        on_transfer_failure=config.transfer.on_failure,
        num_cpus=(config.prefill if role is Role.PREFILL else config.decode).resources.num_cpus,
        num_gpus=(config.prefill if role is Role.PREFILL else config.decode).resources.num_gpus,
        peer_tensor_parallel_size=(
            config.decode if role is Role.PREFILL else config.prefill
        ).tensor_parallel_size,
    )
