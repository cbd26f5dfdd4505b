"""The KV cache of an engine: one full-attention pool group sized from the config's budget."""

from __future__ import annotations

import dataclasses

import torch

from engine.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.model_config import ModelConfig
from kvcache.manager import KVCacheManager
from kvcache.sizing import cuda_free_bytes, device_kv_budget, size_pool_groups
from kvcache.spec import PoolGroupSpec

FULL_GROUP = "full"


def kv_pool_template(model: ModelConfig, page_size: int, dtype: torch.dtype) -> PoolGroupSpec:
    """The single pool group of a Llama-family model (``num_pages`` still to be sized).

    A sliding-window model (Mistral v0.1) keeps full-attention pages: the window is applied by the
    attention, and the pool simply keeps pages the window no longer reads.
    """
    return PoolGroupSpec(
        name=FULL_GROUP,
        layer_ids=tuple(range(model.num_layers)),
        num_pages=2,
        page_size=page_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype,
    )


def activation_peak_estimate(model: ModelConfig, config: EngineConfig) -> int:
    """Rough upper bound of one step's activations in bytes (a profiling run would be exact)."""
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    per_token = (
        4 * model.hidden_size + 3 * model.intermediate_size + model.q_size + 2 * model.kv_size
    )
    logits = config.max_num_seqs * model.vocab_size * 4 * 3  # float32 logits, softmax, sort
    return config.max_num_batched_tokens * per_token * elem + logits


def build_kv_cache(model: ModelConfig, config: EngineConfig, max_model_len: int) -> KVCacheManager:
    """A KVCacheManager with ``config.num_pages`` pages, or as many as the memory budget holds
    (capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use)."""
    device = torch.device(config.device)
    template = kv_pool_template(model, config.page_size, config.torch_dtype)
    if config.num_pages is not None:
        spec = dataclasses.replace(template, num_pages=config.num_pages)
    else:
        budget = config.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                budget = device_kv_budget(
                    cuda_free_bytes(device),
                    config.gpu_memory_fraction,
                    0,
                    activation_peak_estimate(model, config),
                )
            else:
                budget = DEFAULT_CPU_KV_BYTES
        cap = max_model_len * config.max_num_seqs
        if config.kv_max_tokens is not None:
            cap = min(cap, config.kv_max_tokens)
        (spec,) = size_pool_groups([template], budget, max_tokens=cap)
    return KVCacheManager([spec], config.reuse_policy, device)
