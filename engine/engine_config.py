"""Everything needed to build an offline engine: model source, KV cache size, scheduler limits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.model_config import ModelConfig
from kvcache.reuse_policy import ReusePolicy

LOAD_FORMATS: tuple[str, ...] = ("auto", "gguf", "hf", "dummy")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# vLLM's other names of the same dtypes (its ``dtype`` argument and --dtype take them too)
DTYPE_ALIASES: dict[str, str] = {"half": "float16", "float": "float32"}
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32


def dtype_name(value: Any) -> str:
    """The engine's name of a dtype given as vLLM's ``dtype`` takes one: "auto", a name of DTYPES
    or DTYPE_ALIASES, or a torch.dtype of DTYPES. Anything else comes back as given (refused by
    the caller with the list of names)."""
    if isinstance(value, torch.dtype):
        return next((name for name, d in DTYPES.items() if d == value), str(value))
    if isinstance(value, str):
        return DTYPE_ALIASES.get(value, value)
    return value


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one LLMEngine (what ``engine.LLM(...)`` takes as keyword arguments)."""

    model: str = "default"
    """"default" (the embedded SmolLM2-135M-Instruct GGUF), a .gguf file, an HF checkpoint
    directory, or a preset name of the dummy loader."""
    load_format: str = "auto"
    """One of "auto" (from the path), "gguf", "hf", "dummy" (random weights)."""
    dtype: str = "float32"
    """Weights, activations and KV cache: "float32", "bfloat16" or "float16" (vLLM's "half",
    "float" and torch dtypes are taken too), or "auto": the dtype the checkpoint holds
    (engine/loaders/checkpoint_dtype.py; ``resolved`` reads it)."""
    device: str = "cpu"
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int | None = None
    """Pages of each KV pool group, the null page included (as PoolGroupSpec.num_pages); None
    sizes the groups from ``kv_cache_memory_bytes``."""
    kv_cache_memory_bytes: int | None = None
    """KV budget in bytes (not allowed with ``num_pages``); None: 1 GiB on CPU, 90% of the free
    memory left after weights and an activation estimate on CUDA."""
    gpu_memory_fraction: float = 0.9
    """On CUDA, without a byte budget: the share of the free memory (after weights and the
    activation estimate) that the KV pool takes."""
    gpu_memory_utilization: float | None = None
    """vLLM's budget, in place of ``gpu_memory_fraction``: the share of the GPU's whole memory
    this engine may take (weights, activations and KV together, and what loading took outside
    torch's allocator; the KV pool gets what is left of it once the weights are loaded, less the
    activation estimate). More than other processes left free is refused before the weights
    load, as in vLLM. None: ``gpu_memory_fraction``."""
    kv_max_tokens: int | None = None
    """Cap on the tokens the KV pool holds (None: what max_num_seqs sequences of max_model_len
    use). Not allowed with ``num_pages``."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_model_len: int | None = None
    """Longest prompt + output; None takes the model's max_position_embeddings."""
    reuse_policy: str = "all_reusable"
    """Prefix reuse: "none", "all_reusable" or "per_request"."""
    pool_ratio: dict[str, float] | None = None
    """Share of the KV budget per pool group ("full", "swa_<window>"), e.g. {"full": 3,
    "swa_1024": 1}; must name exactly the model's groups. None: in proportion to what one request
    of max_model_len tokens holds in each group. Not allowed with ``num_pages``."""
    swa_scratch_reuse: bool = False
    """Rewrite a long prefill's out-of-window pages of sliding-window groups in place, keeping
    its footprint near (window + chunk) pages; costs prefix hits inside long prompts
    (kvcache/manager.py)."""
    host_tier_bytes: int = 0
    """Host memory beneath the KV pools for reusable pages the device evicts, found again by
    prefix hits and loaded back (pinned memory on CUDA); split between pool groups as the device
    pools are. 0: no host tier."""
    seed: int = 0
    """Seed of the sampler's shared generator (requests without their own seed) and of dummy weights."""
    dummy_config: ModelConfig | dict[str, Any] | None = None
    """ModelConfig (or its field dict) for load_format="dummy" without a preset name."""
    cuda_graphs: bool = True
    """On CUDA, replay decode steps of up to max_num_seqs requests from CUDA graphs captured at
    start-up (engine/cuda_graphs.py); False runs every step eagerly. Ignored on CPU, which has
    none, and with tensor_parallel_size > 1, whose all-reduces are not captured yet (those steps
    run eagerly; the engine logs it)."""
    warm_up: bool = True
    """Run one greedy request through the model when the engine is built (prefill and a decode
    step, then forgotten: no stats, no pages kept, nothing registered for reuse), so that the
    first real request does not pay one-time costs: oneDNN's kernel set-up on CPU (about 0.3 s
    for the embedded model), Triton compiling the kernels' variants on GPUs (seconds;
    LLMEngine.warm_up says which)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (vLLM's name): ranks 1.. run as local processes joined by
    torch.distributed (gloo on CPU, NCCL on CUDA, one GPU per rank); must divide the query heads,
    and the KV heads must divide by it or it by them (KV heads then replicated)."""
    max_stats_len: int = 1000
    """Iteration stats kept between drains: -1 unbounded, 0 none (not recorded), N the newest N."""
    max_request_stats_len: int | None = None
    """Request stats kept between drains, the same way; None: as ``max_stats_len``."""

    def __post_init__(self) -> None:
        owner = "LLM"
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{owner}.model must be a non-empty string, got {self.model!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"{owner}.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # (frozen: normalised once)
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(
                f"{owner}.dtype must be 'auto' or one of {(*DTYPES, *DTYPE_ALIASES)}, got "
                f"{self.dtype!r}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(
                f"{owner}.device must be a torch device string, got {self.device!r}"
            ) from e
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            _positive_int(owner, name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{owner}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires: the requests past it in "
                "the running list would get no token in a step"
            )
        if self.num_pages is not None:
            _positive_int(owner, "num_pages", self.num_pages, minimum=2)
        if self.kv_cache_memory_bytes is not None:
            _positive_int(owner, "kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"{owner}.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}"
            )
        if self.gpu_memory_utilization is not None and not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ValueError(
                f"{owner}.gpu_memory_utilization must be in (0, 1], got "
                f"{self.gpu_memory_utilization!r}"
            )
        if self.kv_max_tokens is not None:
            _positive_int(owner, "kv_max_tokens", self.kv_max_tokens)
        if self.num_pages is not None:
            for sizing in ("kv_cache_memory_bytes", "kv_max_tokens"):
                if getattr(self, sizing) is not None:
                    raise ValueError(
                        f"{owner}.{sizing} sizes the KV pools from a budget; with num_pages every "
                        "pool group gets num_pages pages, so it would not apply (give one or the "
                        "other)"
                    )
        if self.max_model_len is not None:
            _positive_int(owner, "max_model_len", self.max_model_len)
        if self.pool_ratio is not None:
            if self.num_pages is not None:
                raise ValueError(
                    f"{owner}.pool_ratio splits a memory budget; with num_pages every pool group "
                    "gets num_pages pages (give one or the other)"
                )
            if not isinstance(self.pool_ratio, dict) or not self.pool_ratio:
                raise ValueError(
                    f"{owner}.pool_ratio must be a non-empty dict of group name -> share, got {self.pool_ratio!r}"
                )
            bad = sorted(g for g, r in self.pool_ratio.items() if not r > 0)
            if bad:
                raise ValueError(f"{owner}.pool_ratio shares must be > 0, got <= 0 for {bad}")
        if not isinstance(self.swa_scratch_reuse, bool):
            raise ValueError(
                f"{owner}.swa_scratch_reuse must be a bool, got {self.swa_scratch_reuse!r}"
            )
        if self.reuse_policy not in {p.value for p in ReusePolicy}:
            raise ValueError(
                f"{owner}.reuse_policy must be one of {[p.value for p in ReusePolicy]}, got {self.reuse_policy!r}"
            )
        if isinstance(self.host_tier_bytes, bool) or not isinstance(self.host_tier_bytes, int):
            raise ValueError(
                f"{owner}.host_tier_bytes must be an integer, got {self.host_tier_bytes!r}"
            )
        if self.host_tier_bytes < 0:
            raise ValueError(f"{owner}.host_tier_bytes must be >= 0, got {self.host_tier_bytes}")
        if self.host_tier_bytes and not ReusePolicy(self.reuse_policy).reuses:
            raise ValueError(
                f"{owner}.host_tier_bytes={self.host_tier_bytes} needs prefix reuse: with "
                "reuse_policy='none' no page is ever reusable, so nothing would go to the host tier"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"{owner}.seed must be an integer, got {self.seed!r}")
        _positive_int(owner, "tensor_parallel_size", self.tensor_parallel_size)
        if self.host_tier_bytes and self.tensor_parallel_size > 1:
            # Ranks 1.. hold their KV heads in processes of their own: the host tier (rank 0's
            # KVCacheManager) would offload and load back only rank 0's heads.
            raise ValueError(
                f"{owner}.host_tier_bytes is not supported with tensor_parallel_size > 1 yet, got "
                f"{self.host_tier_bytes} with tensor_parallel_size {self.tensor_parallel_size}"
            )
        _positive_int(owner, "max_stats_len", self.max_stats_len, minimum=-1)
        if self.max_request_stats_len is not None:
            _positive_int(owner, "max_request_stats_len", self.max_request_stats_len, minimum=-1)
        if not isinstance(self.warm_up, bool):
            raise ValueError(f"{owner}.warm_up must be true or false, got {self.warm_up!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"{owner}.cuda_graphs must be true or false, got {self.cuda_graphs!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError(
                "dtype 'auto' is read from the checkpoint first (EngineConfig.resolved)"
            )
        return DTYPES[self.dtype]

    def resolved(self, loaded: torch.dtype | None = None) -> EngineConfig:
        """This config with dtype "auto" made the checkpoint's (``loaded``: the dtype of a model
        already loaded, else read from ``model``); other dtypes as they are."""
        if self.dtype != "auto":
            return self
        if loaded is not None:
            return dataclasses.replace(self, dtype=dtype_name(loaded))
        from engine.loaders.checkpoint_dtype import checkpoint_dtype

        found = checkpoint_dtype(self.model, self.load_format, self.dummy_config)
        return dataclasses.replace(self, dtype=found)
