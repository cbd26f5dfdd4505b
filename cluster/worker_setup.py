"""From the cluster config to one worker's engine: the translation both worker roles share."""

from __future__ import annotations

import os

from cluster.config import ClusterConfig
from engine.cpu_share import apply_cpu_share
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
        device=gpu_device() if on_gpu else "cpu",
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


# Set on GPU workers by cluster/builder.py: Ray then leaves CUDA_VISIBLE_DEVICES alone, so every GPU
# of the node is visible and a prefill worker can open a decode worker's KV pool over CUDA IPC.
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def gpu_device() -> str:
    """This worker's GPU as a torch device: "cuda" when Ray narrowed CUDA_VISIBLE_DEVICES to it,
    else "cuda:<index>" of the GPU Ray assigned, among the ones this process sees; that GPU also
    becomes the calling thread's current device (the actor's, which builds the engine)."""
    if os.environ.get(NOSET_VISIBLE_DEVICES) != "1":
        return "cuda"
    import ray
    import torch

    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return "cuda"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if ids[0] not in order:
        raise RuntimeError(f"Ray assigned GPU {ids[0]}, which is not among the visible {order}")
    index = order.index(ids[0])
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def build_engine(config: ClusterConfig, role: str) -> LLMEngine:
    engine_config = engine_config_for(config, role)
    pool = config.prefill if role == "prefill" else config.decode
    apply_cpu_share(pool.resources.num_cpus, engine_config.device)
    return LLMEngine.from_config(engine_config)
