"""The KV cache of an engine: one pool group per attention window of the model, sized from the
config's budget, and refused when one request of max_model_len tokens cannot fit."""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.model_config import ModelConfig
from kvcache.head_shard import HeadShard
from kvcache.manager import KVCacheManager
from kvcache.sizing import (
    CudaMemory,
    check_one_request_fits,
    check_share_left,
    cuda_free_bytes,
    cuda_memory,
    device_kv_budget,
    host_pages_per_group,
    non_torch_growth,
    pages_per_request,
    size_pool_groups,
    utilization_kv_budget,
)
from kvcache.spec import MapperKind, PoolGroupSpec

logger = logging.getLogger(__name__)


def kv_pool_templates(
    model: ModelConfig, page_size: int, dtype: torch.dtype, shard: HeadShard | None = None
) -> list[PoolGroupSpec]:
    """The model's pool groups (``num_pages`` still to be sized): "full" for its full-attention
    layers, "swa_<W>" for the layers of each window size W; full first, then by window. With a
    tensor-parallel ``shard``: its KV heads only (HND, or REPLICATED when ranks share heads)."""
    if shard is None:
        shard = HeadShard(0, model.num_kv_heads, model.num_kv_heads)
    layers: dict[int | None, list[int]] = {}
    for layer in range(model.num_layers):
        layers.setdefault(model.layer_window(layer), []).append(layer)
    order = sorted(layers, key=lambda w: -1 if w is None else w)
    return [
        PoolGroupSpec(
            name=model.kv_group(layers[window][0]),
            layer_ids=tuple(layers[window]),
            num_pages=2,
            page_size=page_size,
            num_kv_heads=shard.count,
            head_dim=model.head_dim,
            dtype=dtype,
            mapper_kind=MapperKind.REPLICATED if shard.replicated else MapperKind.HND,
            sliding_window=window,
            head_start=shard.start,
        )
        for window in order
    ]


def memory_at_start(config: EngineConfig, device: str) -> CudaMemory | None:
    """The device's memory before the engine loads its model onto ``device``, where
    gpu_memory_utilization sizes the KV cache (a CUDA device); None elsewhere. A share other
    processes have not left is refused here, before minutes of loading (ValueError)."""
    utilization = config.gpu_memory_utilization
    if torch.device(device).type != "cuda" or utilization is None:
        return None
    now = cuda_memory(device)
    check_share_left(now.total, now.free + now.torch_reserved, utilization)
    return now


def log_footprint(config: EngineConfig, device: torch.device, at_start: CudaMemory | None) -> None:
    """Once the engine is built and warmed up: what it holds of its gpu_memory_utilization share,
    in torch's allocator and outside it; a warning where the activation estimate or libraries
    loaded after sizing took it past the share."""
    if at_start is None or config.gpu_memory_utilization is None:
        return
    now = cuda_memory(device)
    outside = non_torch_growth(at_start, now)
    held = now.torch_reserved - at_start.torch_reserved + outside
    share = int(now.total * config.gpu_memory_utilization)
    gib = 1 << 30
    log = logger.warning if held > share else logger.info
    log(
        "GPU memory: the engine holds %.2f GiB (%.2f outside torch's allocator) of its %.2f GiB "
        "share (gpu_memory_utilization=%s)",
        held / gib,
        outside / gib,
        share / gib,
        config.gpu_memory_utilization,
    )


def activation_peak_estimate(model: ModelConfig, config: EngineConfig) -> int:
    """Rough upper bound of one step's activations in bytes (a profiling run would be exact)."""
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    per_token = (
        4 * model.hidden_size + 3 * model.intermediate_size + model.q_size + 2 * model.kv_size
    )
    logits = config.max_num_seqs * model.vocab_size * 4 * 3  # float32 logits, softmax, sort
    return config.max_num_batched_tokens * per_token * elem + logits


def build_kv_cache(
    model: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    shard: HeadShard | None = None,
    memory_at_start: CudaMemory | None = None,
) -> KVCacheManager:
    """A KVCacheManager with ``config.num_pages`` pages per group, or as many as the memory budget
    holds (split by ``config.pool_ratio``, or by what one request holds in each group; capped at
    what ``max_num_seqs`` requests of ``max_model_len`` tokens can use). Logs the pages per group.
    Under ``gpu_memory_utilization``, what the engine took outside torch's allocator since
    ``memory_at_start`` (the device before its model was loaded) counts against its share.

    With ``config.host_tier_bytes``, a host tier beneath the groups (kvcache/host_tier.py).

    Raises kvcache.sizing.KVSizingError (a ValueError; ``setting`` says what to change) for a bad
    pool_ratio, when some group cannot hold one request of ``max_model_len`` tokens, or when the
    host tier holds less than one page of some group.
    """
    device = torch.device(config.device)
    templates = kv_pool_templates(model, config.page_size, config.torch_dtype, shard)
    need = pages_per_request(templates, max_model_len, config.prefill_chunk_size)
    if config.num_pages is not None:
        specs = [dataclasses.replace(t, num_pages=config.num_pages) for t in templates]
    else:
        budget = config.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda" and config.gpu_memory_utilization is not None:
                now = cuda_memory(device)
                budget = utilization_kv_budget(
                    now.total,
                    now.free,
                    now.torch_reserved,
                    config.gpu_memory_utilization,
                    activation_peak_estimate(model, config),
                    0 if memory_at_start is None else non_torch_growth(memory_at_start, now),
                )
            elif device.type == "cuda":
                budget = device_kv_budget(
                    cuda_free_bytes(device),
                    config.gpu_memory_fraction,
                    0,
                    activation_peak_estimate(model, config),
                )
            else:
                budget = DEFAULT_CPU_KV_BYTES
        specs = size_pool_groups(
            templates,
            budget,
            need,
            max_requests=config.max_num_seqs,
            max_tokens=config.kv_max_tokens,
            pool_ratios=config.pool_ratio,
        )
        budgeted = size_pool_groups(
            templates, budget, need, max_tokens=config.kv_max_tokens, pool_ratios=config.pool_ratio
        )
        if budgeted != specs:  # (a budget past what the scheduler can use is not allocated)
            logger.info(
                "KV cache: the budget of %d B holds more than max_num_seqs (%d) requests of "
                "max_model_len (%d) tokens can use: %s",
                budget,
                config.max_num_seqs,
                max_model_len,
                ", ".join(
                    f"{s.name} {s.usable_pages} of {b.usable_pages} pages"
                    for s, b in zip(specs, budgeted, strict=True)
                ),
            )
    logger.info(
        "KV cache: %s (pages of %d tokens; one request of %d tokens holds at most %s)",
        ", ".join(f"{s.name} {s.usable_pages} pages of {s.page_bytes} B" for s in specs),
        config.page_size,
        max_model_len,
        need,
    )
    check_one_request_fits(specs, need, max_model_len)
    host_pages = None
    if config.host_tier_bytes:
        host_pages = host_pages_per_group(specs, config.host_tier_bytes)
        logger.info(
            "KV host tier: %s",
            ", ".join(f"{s.name} {host_pages[s.name]} pages" for s in specs),
        )
    return KVCacheManager(specs, config.reuse_policy, device, config.swa_scratch_reuse, host_pages)
