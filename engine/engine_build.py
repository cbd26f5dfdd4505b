"""Building an LLMEngine from its EngineConfig: load the model (rank 0 of a tensor-parallel engine,
the other ranks started and given their page counts), size the KV cache, warm up."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch

from engine.engine_config import EngineConfig
from engine.gpu_sizing_lock import gpu_sizing_turn
from engine.kv_setup import build_kv_cache, log_footprint, memory_at_start
from engine.scheduler_config import SchedulerConfig
from engine.tp.context import TPContext
from engine.tp.local_ranks import LocalRanks, StartRanks, rank_device
from engine.tp.messages import TPSetup
from engine.tp.partition import TPPartition, tp_problems
from kvcache.sizing import CudaMemory

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine
    from engine.loaders import LoadedModel


def engine_from_config(
    cls: type[LLMEngine], config: EngineConfig, start_ranks: StartRanks | None
) -> LLMEngine:
    """LLMEngine.from_config: load the model, then ``engine_from_loaded`` (on a GPU shared
    under gpu_memory_utilization, in this GPU's sizing turn: engine/gpu_sizing_lock.py)."""
    try:
        config = config.resolved()
    except OSError as e:
        raise ValueError(f"LLM.model={config.model!r}: {e}") from e
    device = rank_device(config, 0) if config.tensor_parallel_size > 1 else config.device
    with gpu_sizing_turn(device, config.gpu_memory_utilization):
        return _engine_from_config(cls, config, start_ranks, device)


def _engine_from_config(
    cls: type[LLMEngine], config: EngineConfig, start_ranks: StartRanks | None, device: str
) -> LLMEngine:
    from engine.loaders import load_model  # deferred: pulls in gguf, safetensors, the model

    at_start = memory_at_start(config, device)
    if config.tensor_parallel_size > 1:
        return _engine_from_config_tp(cls, config, start_ranks or LocalRanks, at_start)
    try:
        loaded = load_model(
            config.model,
            config.load_format,
            config.torch_dtype,
            config.device,
            config.dummy_config,
            config.seed,
        )
    except (FileNotFoundError, TypeError) as e:
        raise ValueError(
            f"LLM.model={config.model!r} (load_format={config.load_format!r}): {e}"
        ) from e
    return engine_from_loaded(cls, loaded, config, memory_at_start=at_start)


def _engine_from_config_tp(
    cls: type[LLMEngine], config: EngineConfig, start_ranks: StartRanks, at_start: CudaMemory | None
) -> LLMEngine:
    """Rank 0 here, ranks 1.. started by ``start_ranks``."""
    from engine.loaders import load_model
    from engine.loaders.load import read_model_config

    size = config.tensor_parallel_size
    try:
        model_config = read_model_config(config.model, config.load_format, config.dummy_config)
    except (FileNotFoundError, TypeError) as e:
        raise ValueError(
            f"LLM.model={config.model!r} (load_format={config.load_format!r}): {e}"
        ) from e
    problems = tp_problems(model_config, size)
    if problems:
        raise ValueError("LLM.tensor_parallel_size: " + "; ".join(problems))
    ranks = start_ranks(config, size)  # (LocalRanks checks this host has the GPUs)
    try:
        tp = TPContext(TPPartition(model_config, 0, size), ranks.group)
        loaded = load_model(
            config.model,
            config.load_format,
            config.torch_dtype,
            rank_device(config, 0),
            config.dummy_config,
            config.seed,
            tp=tp,
        )
        engine = engine_from_loaded(cls, loaded, config, tp, at_start)
    except BaseException:
        ranks.kill()
        raise
    engine.local_ranks = ranks
    if isinstance(ranks, LocalRanks):
        # The offline API's ranks stopped when the engine goes or the interpreter exits, as
        # vLLM's workers are: a script that never called LLM.close() left each rank to find rank
        # 0 gone and log a crash. (LocalRanks.close is idempotent; the finalizer holds the
        # ranks, not the engine. A worker's Ray ranks end with its actor.)
        weakref.finalize(engine, ranks.close)
    return engine


def engine_from_loaded(
    cls: type[LLMEngine],
    loaded: LoadedModel,
    config: EngineConfig,
    tp: TPContext | None = None,
    memory_at_start: CudaMemory | None = None,
) -> LLMEngine:
    """LLMEngine.from_loaded: the scheduler limits and the KV cache from ``config``, the engine
    over ``loaded``, warmed up."""
    if tp is None and config.tensor_parallel_size > 1:
        raise ValueError(
            f"LLM.tensor_parallel_size={config.tensor_parallel_size} with a loaded model: it is "
            "one process's, whole; LLM(model, tensor_parallel_size=N) starts the ranks"
        )
    mc = loaded.config
    first = next(loaded.model.parameters())
    config = config.resolved(first.dtype)
    model_device = first.device
    if torch.device(config.device) != model_device:
        config = dataclasses.replace(config, device=str(model_device))
    max_model_len = (
        config.max_model_len if config.max_model_len is not None else mc.max_position_embeddings
    )
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"LLM.max_model_len={max_model_len} exceeds the model's max_position_embeddings={mc.max_position_embeddings}"
        )
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk_size=config.prefill_chunk_size,
        max_model_len=max_model_len,
        page_size=config.page_size,
    )
    shard = tp.partition.kv if tp is not None else None
    kv = build_kv_cache(mc, config, max_model_len, shard, memory_at_start)
    if tp is not None and tp.size > 1:
        assert tp.group is not None
        tp.group.broadcast_object(TPSetup({n: s.num_pages for n, s in kv.specs.items()}))
    engine = cls(
        loaded.model,
        mc,
        kv,
        sched,
        tokenizer=loaded.tokenizer,
        seed=config.seed,
        max_stats_len=config.max_stats_len,
        max_request_stats_len=config.max_request_stats_len,
        model_name=loaded.name,
        model_fingerprint=loaded.fingerprint,
        cuda_graphs=config.cuda_graphs,
        tp=tp,
    )
    if config.warm_up:
        engine.warm_up()
    log_footprint(config, kv.device, memory_at_start)
    return engine
