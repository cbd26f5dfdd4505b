"""The ``model`` section: which checkpoint every worker loads, and how."""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any, Literal

from pydantic import Field, model_validator

from cluster.config.base import Section, check_fields

DEFAULT_SOURCE = "default"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


class DummyModelConfig(Section):
    """The dimensions of a randomly initialised Llama-family model (HF ``config.json`` names)."""

    model_type: Literal["llama", "mistral", "qwen2", "qwen3"] = Field(
        "llama", description="Architecture variant of the Llama family."
    )
    hidden_size: int = Field(gt=0, description="Width of the residual stream.")
    intermediate_size: int = Field(gt=0, description="Width of the MLP's hidden layer.")
    num_hidden_layers: int = Field(gt=0, description="Number of decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads per layer.")
    num_key_value_heads: int = Field(
        gt=0, description="Key/value heads per layer (GQA); must divide num_attention_heads."
    )
    head_dim: int | None = Field(
        None, gt=0, description="Per-head width; None = hidden_size / num_attention_heads."
    )
    vocab_size: int = Field(gt=0, description="Vocabulary size.")
    max_position_embeddings: int = Field(8192, gt=0, description="Longest supported context.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="HF rope_scaling dict (e.g. Llama 3.1's), or None for plain RoPE."
    )
    rms_norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the RMS norms.")
    tie_word_embeddings: bool = Field(
        False, description="Share the input embedding with the LM head."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> DummyModelConfig:
        issues: list[tuple[str, str]] = []
        if self.num_attention_heads % self.num_key_value_heads:
            issues.append(
                (
                    "num_key_value_heads",
                    f"must divide num_attention_heads ({self.num_attention_heads}), "
                    f"got {self.num_key_value_heads}",
                )
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            issues.append(
                (
                    "hidden_size",
                    f"must be a multiple of num_attention_heads ({self.num_attention_heads}) "
                    f"when head_dim is not set, got {self.hidden_size}",
                )
            )
        check_fields(issues)
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def as_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json``-style dict the dummy loader builds a model from."""
        return {**self.model_dump(exclude_none=True), "head_dim": self.resolved_head_dim}


class ModelConfig(Section):
    """Which model every worker loads. Prefill and decode workers must load the same one."""

    source: str = Field(
        DEFAULT_SOURCE,
        min_length=1,
        description=(
            f'"{DEFAULT_SOURCE}" for the embedded {EMBEDDED_MODEL_NAME} GGUF, or a path (relative '
            "to the working directory of `duet serve`, made absolute there for every worker) to "
            "a .gguf file or an HF checkpoint directory (config.json + safetensors + "
            "tokenizer.json), at the same place on every node. With load_format dummy, only a "
            "label."
        ),
    )
    load_format: Literal["auto", "gguf", "hf", "dummy"] = Field(
        "auto",
        description=(
            "auto: gguf for a .gguf file or the embedded model, hf for a directory; "
            "dummy: random weights shaped by dummy_config (benchmarks without a checkpoint)."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16", "half", "float", "auto"] = Field(
        "float32",
        description=(
            "Weights, activations and KV cache dtype (half = float16, float = float32, as vLLM "
            "names them). auto: the dtype the checkpoint holds, as transformers' "
            'torch_dtype="auto" reads it (config.json, else its safetensors); float32 for GGUF '
            "files and dummy weights. Unlike vLLM's auto, a float32 checkpoint stays float32."
        ),
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt + output in tokens; None = the model's own limit."
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="Name in the OpenAI API and metrics; None = derived from source.",
    )
    dummy_config: DummyModelConfig | None = Field(
        None, description="Model dimensions; required with load_format dummy, forbidden otherwise."
    )
    seed: int = Field(0, ge=0, description="Seed for dummy weights and for sampling.")
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description=(
            "auto: the sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
            "the repetition, presence and frequency penalties, and a chat request's max_tokens) "
            "take what the checkpoint's generation_config.json sets, "
            "as vLLM's --generation-config auto (only HF checkpoint directories have one); "
            "none: Duet's defaults (temperature 1, top_p 1, top_k off, a chat request's "
            "max_tokens what fits the model)."
        ),
    )

    @model_validator(mode="after")
    def _check_format(self) -> ModelConfig:
        issues: list[tuple[str, str]] = []
        if self.load_format == "dummy" and self.dummy_config is None:
            issues.append(("dummy_config", "required when load_format is 'dummy'"))
        if self.load_format != "dummy" and self.dummy_config is not None:
            issues.append(
                ("dummy_config", f"only allowed with load_format 'dummy', got '{self.load_format}'")
            )
        if self.is_embedded and self.load_format == "hf":
            issues.append(
                (
                    "load_format",
                    f"the embedded model is a GGUF file: must be one of 'auto', 'gguf', 'dummy' "
                    f"with source '{DEFAULT_SOURCE}', got 'hf'",
                )
            )
        limit = None if self.dummy_config is None else self.dummy_config.max_position_embeddings
        if limit is not None and self.max_model_len is not None and self.max_model_len > limit:
            issues.append(
                (
                    "max_model_len",
                    f"must be <= dummy_config.max_position_embeddings ({limit}), "
                    f"got {self.max_model_len}",
                )
            )
        check_fields(issues)
        return self

    @property
    def is_embedded(self) -> bool:
        """True when the workers load the embedded SmolLM2 GGUF."""
        return self.source == DEFAULT_SOURCE and self.load_format != "dummy"

    @property
    def worker_source(self) -> str:
        """``source`` as the workers get it: a path made absolute here, in the server's working
        directory. (A worker resolves a relative one in its own: Ray's unpacked working_dir, or
        wherever `ray start` ran on a joined node, and found no model there.)"""
        if self.is_embedded or self.load_format == "dummy":
            return self.source
        return os.path.abspath(self.source)

    @property
    def model_name(self) -> str:
        """The served name: served_model_name, else the embedded model's name, else the source
        (for a path: the directory name, or the file name without .gguf)."""
        if self.served_model_name is not None:
            return self.served_model_name
        if self.is_embedded:
            return EMBEDDED_MODEL_NAME
        if self.load_format == "dummy":
            return self.source
        path = PurePath(self.source)
        return path.stem if path.suffix == ".gguf" else path.name
