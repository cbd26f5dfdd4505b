"""vLLM's ``LLM(...)`` arguments as an EngineConfig: its names for Duet's settings, the values of
its other arguments that ask nothing of Duet, and the device it would pick."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import torch

from engine.engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig

log = logging.getLogger(__name__)


def _flag(convert: Callable[[bool], Any]) -> Callable[[str, Any], Any]:
    def check(name: str, given: Any) -> Any:
        if not isinstance(given, bool):
            raise ValueError(f"{name} must be a bool, got {given!r}")
        return convert(given)

    return check


# vLLM's LLM arguments that name an EngineConfig setting: (vLLM name, Duet field, its value).
_VLLM_ALIASES: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "enable_prefix_caching": ("reuse_policy", _flag(lambda on: "all_reusable" if on else "none")),
    "enforce_eager": ("cuda_graphs", _flag(lambda eager: not eager)),
    "block_size": ("page_size", lambda _name, size: size),  # (EngineConfig checks it)
}
# vLLM's LLM arguments Duet takes at the values that ask nothing of it; others are refused.
_VLLM_NO_OPS: dict[str, tuple[Any, ...]] = {
    # Duet's model classes are its own: no checkpoint's code ever runs, with or without leave.
    "trust_remote_code": (False, True),
    "kv_cache_dtype": ("auto",),  # the KV cache is in the model's dtype
    "quantization": (None,),
    # Asking for nothing Duet lacks: the checkpoint as it is on disk, no offloaded weights,
    # prefills always chunked (prefill_chunk_size), no periodic stats log.
    "revision": (None,),
    "download_dir": (None,),
    "tokenizer_mode": ("auto",),
    "hf_overrides": (None, {}),
    "cpu_offload_gb": (0,),
    "enable_chunked_prefill": (None, True),
    "disable_log_stats": (True,),
    # (lm-evaluation-harness's vLLM backend passes these at their defaults)
    "enable_lora": (False, None),
    "tokenizer_revision": (None,),
    "pipeline_parallel_size": (1,),
    "task": ("auto", "generate"),
    "compilation_config": (None,),
}
# Sizes of LoRA adapters: inert with enable_lora off (as in vLLM), the only way Duet runs.
_LORA_SIZES = ("max_lora_rank", "max_loras", "max_cpu_loras")


def engine_config_of(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **kwargs)``: EngineConfig's fields, vLLM's names for
    them, vLLM's arguments at values that ask nothing of Duet; anything else is refused by
    name (ValueError). The device defaults to a visible GPU, as vLLM picks its platform."""
    kwargs = dict(kwargs)
    for name, (field, value) in _VLLM_ALIASES.items():
        if name not in kwargs:
            continue
        given = kwargs.pop(name)
        if field in kwargs:
            raise ValueError(f"give {name} or {field}, not both")
        kwargs[field] = value(name, given)
    for name, allowed in _VLLM_NO_OPS.items():
        if name in kwargs:
            given = kwargs.pop(name)
            if not any(given is a or (type(given) is type(a) and given == a) for a in allowed):
                raise ValueError(
                    f"{name}={given!r} is not supported by Duet (it takes {name} only as "
                    f"{' or '.join(repr(a) for a in allowed)})"
                )
    for name in _LORA_SIZES:
        given = kwargs.pop(name, None)
        if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
            raise ValueError(f"{name} must be an integer, got {given!r}")
    if "seed" in kwargs and kwargs["seed"] is None:  # vLLM's: a seed from entropy
        kwargs["seed"] = secrets.randbelow(2**63)
    if "tokenizer" in kwargs:  # vLLM's: another tokenizer than the checkpoint's
        given = kwargs.pop("tokenizer")
        if given is not None and given != model:
            raise ValueError(
                f"tokenizer={given!r}: Duet uses the checkpoint's own tokenizer (give None or "
                "the model's path)"
            )
    if {"gpu_memory_utilization", "gpu_memory_fraction"} <= set(kwargs):
        raise ValueError("give gpu_memory_utilization or gpu_memory_fraction, not both")
    if {"num_pages", "gpu_memory_fraction"} <= set(kwargs):  # (its default is a number)
        raise ValueError(
            "gpu_memory_fraction sizes the KV pools from the free memory; with num_pages every "
            "pool group gets num_pages pages, so it would not apply (give one or the other)"
        )
    if "device" not in kwargs:
        kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(kwargs["device"]).type != "cuda" and "gpu_memory_utilization" in kwargs:
        # (vLLM's CPU build ignores it too; a script written for a GPU still runs)
        log.warning(
            "gpu_memory_utilization has no effect on %s: the KV cache takes "
            "kv_cache_memory_bytes (default %d B) there",
            kwargs["device"],
            DEFAULT_CPU_KV_BYTES,
        )
    unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown LLM arguments {sorted(unknown)}; expected some of {sorted(EngineConfig.__dataclass_fields__)}"
        )
    return EngineConfig(model=model, **kwargs)
