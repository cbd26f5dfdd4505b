"""The shape of a Llama-family model, independent of where its weights come from.

One frozen dataclass that the model, the loaders and the KV cache sizing agree on. HF ``config.json``
dicts enter through :meth:`ModelConfig.from_hf_config`; GGUF metadata through engine/loaders/gguf_config.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

# HF defaults where a config.json leaves a key out (the values of the transformers config classes).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class RopeScaling:
    """Context extension of rotary embeddings.

    ``llama3``: frequencies with wavelength above ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``, those below ``original / high_freq_factor`` are kept, and the band in
    between is interpolated smoothly. ``linear``: every frequency is divided by ``factor``.
    """

    rope_type: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported; expected 'llama3' or 'linear'"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3)."""

    architecture: str
    """HF ``model_type``: one of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when smaller than num_heads); num_heads must be a multiple of it."""
    head_dim: int
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    rms_norm_eps: float = _DEFAULT_RMS_NORM_EPS
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    """Per-frequency divisors (llama.cpp's ``rope_freqs`` tensor, head_dim/2 values), applied after
    ``rope_scaling``; GGUF files of Llama 3.1+ carry their context extension this way."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2 always)."""
    attention_out_bias: bool = False
    """Bias on the output projection (Llama's ``attention_bias`` covers it too; Qwen2's does not)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys before rotary (Qwen3)."""
    sliding_window: int | None = None
    """Attention window in tokens for every layer (Mistral v0.1), None for full attention."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    """End-of-sequence ids of the model config (a list in Llama 3 instruct configs)."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors needs head_dim/2 = {self.head_dim // 2} values, got {len(self.rope_freq_factors)}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from this class's own field names (the inverse of ``dataclasses.asdict``)."""
        values = dict(values)
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        if values.get("eos_token_ids") is not None:
            values["eos_token_ids"] = _as_id_tuple(values["eos_token_ids"])
        if values.get("rope_freq_factors") is not None:
            values["rope_freq_factors"] = tuple(float(x) for x in values["rope_freq_factors"])
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig fields {sorted(unknown)}; expected some of {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**values)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Translate a HF ``config.json`` dict (transformers 4 or 5 spelling of rope parameters)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("mlp_bias"):
            raise ValueError(f"model_type {model_type!r} with mlp_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        bias = bool(hf.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, out_bias = True, False
        elif model_type == "mistral":
            qkv_bias, out_bias = False, False
        else:
            qkv_bias, out_bias = bias, bias
        rope_theta, rope_scaling = _rope_from_hf(hf)
        return cls(
            architecture=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window_from_hf(model_type, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
        )


def _as_id_tuple(value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes one "rope_parameters" dict; older configs have rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    merged = {**legacy, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(merged["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"rope type {rope_type!r} of model_type {hf.get('model_type')!r} is not supported; expected 'default', 'linear' or 'llama3'"
    )


def _sliding_window_from_hf(model_type: str, hf: dict[str, Any]) -> int | None:
    if model_type == "mistral":
        window = hf.get("sliding_window")
        return int(window) if window else None
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        # Qwen's window applies to only some layers (max_window_layers), which one pool group cannot hold.
        raise ValueError(f"model_type {model_type!r} with use_sliding_window=True is not supported")
    return None
