"""A worker's engine, built from its WorkerSpec on its own node (where its GPU is picked)."""

from __future__ import annotations

import dataclasses
import os

from engine.cpu_share import apply_cpu_share
from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.tp.local_ranks import Ranks, StartRanks
from kvcache.sizing import KVSizingError
from worker_common.config_error import ConfigError
from worker_common.messages import WorkerSpec

# Set on GPU workers by cluster/builder.py: Ray then leaves CUDA_VISIBLE_DEVICES alone, so every GPU
# of the node is visible and a decode worker can open a prefill worker's KV pools over CUDA IPC.
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


def build_engine(spec: WorkerSpec) -> LLMEngine:
    """The worker's engine. A KV cache its settings cannot size (a pool_ratio naming groups the
    model lacks, or a group that cannot hold one max_model_len request) is a ConfigError naming the
    cluster fields to change.

    On a CPU device it first sizes this process's torch threads to the worker's CPUs and returns it
    to the default priority (engine/cpu_share.py): call it before the worker's first torch op."""
    config = spec.engine
    if config.device == "cuda":
        config = dataclasses.replace(config, device=gpu_device())
    apply_cpu_share(spec.num_cpus, config.device)
    where = f"{spec.worker_id} start-up"
    try:
        engine = LLMEngine.from_config(config, _start_ranks(spec))
    except KVSizingError as e:
        raise ConfigError(where, [f"{_SIZING_FIELDS[e.setting]}: {e}"]) from e
    return engine


def _start_ranks(spec: WorkerSpec) -> StartRanks | None:
    """Ranks 1.. of a tensor-parallel worker as Ray actors in its placement group."""
    if spec.engine.tensor_parallel_size == 1:
        return None

    def start(config: EngineConfig, size: int) -> Ranks:
        from worker_common.tp_ranks import RayRanks

        return RayRanks(config, size, spec.worker_id, spec.num_cpus, spec.num_gpus, spec.log_level)

    return start


# What a kvcache.sizing.KVSizingError asks to change, in the cluster config's words.
_SIZING_FIELDS = {
    "pool_ratio": "kvcache.pool_ratio",
    "host_tier_bytes": "kvcache.host_tier_bytes",
    "budget": "kvcache.num_pages / cpu_bytes / gpu_memory_fraction / pool_ratio, or model.max_model_len",
}
