"""``LLM.llm_engine`` as code written for vLLM reads it: the tokenizer and the model config's
common fields, and a refusal naming Duet's own API for anything else.

vLLM users reach through ``llm.llm_engine`` mostly for ``get_tokenizer()`` / ``tokenizer`` and for
``model_config.max_model_len`` (lm-evaluation-harness, benchmark scripts); the rest of vLLM's
LLMEngine (add_request with prompt dicts, abort_request of a list, the executor and its workers)
has no counterpart here with the same meaning, so it fails as a missing attribute that says
where Duet's engine is (``llm.engine``) rather than half-working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch

from engine.hf_tokenizer_view import HFTokenizerView

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine


class VLLMModelConfigView:
    """vLLM's ``ModelConfig`` fields that scripts read: ``model``, ``max_model_len``, ``dtype``,
    ``get_vocab_size()``, ``get_hidden_size()``; Duet's whole config is ``llm.engine.model_config``."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    @property
    def model(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (what ``dtype`` resolved to)."""
        return next(self._engine.runner.model.parameters()).dtype

    def get_vocab_size(self) -> int:
        return self._engine.model_config.vocab_size

    def get_hidden_size(self) -> int:
        return self._engine.model_config.hidden_size

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"llm.llm_engine.model_config.{name}: Duet offers only model, max_model_len, dtype, "
            "get_vocab_size() and get_hidden_size() of vLLM's ModelConfig; the model's whole "
            "config is llm.engine.model_config (engine.model_config.ModelConfig)"
        )


class VLLMEngineView:
    """What ``llm.llm_engine`` offers of vLLM's LLMEngine: ``get_tokenizer()``, ``tokenizer``
    (both transformers-style, as ``LLM.get_tokenizer()``), ``model_config`` and
    ``get_model_config()``."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.model_config = VLLMModelConfigView(engine)

    def get_tokenizer(self) -> HFTokenizerView | None:
        tokenizer = self._engine.tokenizer
        return None if tokenizer is None else HFTokenizerView(tokenizer)

    @property
    def tokenizer(self) -> HFTokenizerView | None:
        return self.get_tokenizer()

    def get_model_config(self) -> VLLMModelConfigView:
        return self.model_config

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"llm.llm_engine.{name}: Duet's LLM offers only get_tokenizer(), tokenizer, "
            "model_config and get_model_config() of vLLM's LLMEngine; Duet's own engine is "
            "llm.engine (engine.engine_core.LLMEngine: add_request, step, abort_request)"
        )
