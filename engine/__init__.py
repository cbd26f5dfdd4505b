"""The engine shared by both worker roles: model, loaders, tokenizer, scheduler, runner, sampler.

The public names load lazily, so ``import engine.forward_batch`` (or the request types) does not
pull in the model and the loaders.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchParams
    from engine.engine_config import EngineConfig
    from engine.engine_core import LLMEngine
    from engine.llm import LLM
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams

_EXPORTS: dict[str, str] = {
    "BeamSearchParams": "engine.beam_search",
    "LLM": "engine.llm",
    "LLMEngine": "engine.engine_core",
    "EngineConfig": "engine.engine_config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "BeamSearchParams",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
