"""The shape of a decoder model (the Llama family, and Gemma 3's text model), independent of where
its weights come from.

One frozen dataclass that the model, the loaders and the KV cache sizing agree on. HF ``config.json``
dicts enter through :meth:`ModelConfig.from_hf_config` (Gemma 3's through engine/gemma3_config.py);
GGUF metadata through engine/loaders/gguf_config.py.

Attention per layer: ``layer_types`` says which layers use a sliding window of ``sliding_window``
tokens; each such window size is its own KV pool group (``kv_group``), full-attention layers share
the group "full".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcache.spec import group_name

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# HF defaults where a config.json leaves a key out (the values of the transformers config classes).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6

# transformers' defaults for keys a config.json leaves out, where the four model types differ (a
# key present as null falls back as transformers' does: the KV heads to the query heads).
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "sliding_window": 4096},
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    },
}


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
    """Everything needed to build a decoder: the Llama family (Llama 2/3, Mistral, Qwen2/2.5,
    Qwen3) or Gemma 3's text model."""

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
    """Width of the gated MLP."""
    hidden_act: str = "silu"
    """Gate activation of the MLP: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)."""
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
    """Attention window in tokens of the sliding-window layers (a query at p reads p - W + 1 .. p)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention"; empty: every layer slides when
    ``sliding_window`` is set (Mistral), none otherwise."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers, which then get plain RoPE (Gemma 3's local base);
    None: every layer uses ``rope_theta`` and ``rope_scaling``."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this to the power -0.5 (Gemma); None: head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores become ``cap * tanh(score / cap)`` before the softmax; None: no cap."""
    final_logit_softcapping: float | None = None
    """Logits become ``cap * tanh(logit / cap)``; None: no cap."""
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
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if bad:
                raise ValueError(
                    f"layer_types may hold {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r} only, got {bad}"
                )
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ValueError(
                    "layer_types names sliding_attention layers but sliding_window is None"
                )
        if self.rope_local_theta is not None and self.architecture != "gemma3_text":
            raise ValueError("rope_local_theta is implemented for architecture 'gemma3_text' only")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def attention_types(self) -> tuple[str, ...]:
        """The attention type of every layer: "full_attention" or "sliding_attention"."""
        if self.layer_types:
            return self.layer_types
        kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
        return (kind,) * self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """Attention window of ``layer`` in tokens; None for full attention."""
        return self.sliding_window if self.attention_types[layer] == SLIDING_ATTENTION else None

    def kv_group(self, layer: int) -> str:
        """The KV pool group holding ``layer`` ("full", or "swa_<window>")."""
        return group_name(self.layer_window(layer))

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
        if values.get("layer_types") is not None:
            values["layer_types"] = tuple(values["layer_types"])
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
        if model_type == "gemma3_text":
            from engine.gemma3_config import gemma3_config_from_hf  # its own module; no cycle

            return gemma3_config_from_hf(hf)
        if model_type == "gemma3":
            raise ValueError(
                "model_type 'gemma3' (Gemma3ForConditionalGeneration) is the multimodal model and is "
                "not supported; the text model 'gemma3_text' (Gemma3ForCausalLM) is"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        hf = {**_TYPE_DEFAULTS[model_type], **hf}
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
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            qk_norm=model_type == "qwen3",
            **_windows_from_hf(model_type, hf),
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
    """RoPE of a config with one set of parameters for every layer, as transformers 5 reads it
    (PreTrainedConfig.convert_rope_params_to_dict): a ``rope_scaling`` dict, when set, replaces
    ``rope_parameters`` whole (its theta included); ``rope_theta`` from the dict, else the
    top-level key; a top-level ``original_max_position_embeddings`` overrides the dict's."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta")
    if theta is None:
        theta = hf.get("rope_theta")
    return rope_from_params(
        rope,
        _DEFAULT_ROPE_THETA if theta is None else float(theta),
        hf.get("max_position_embeddings"),
        hf.get("model_type"),
        hf.get("original_max_position_embeddings"),
    )


def rope_from_params(
    rope: dict[str, Any],
    theta: float,
    max_position_embeddings: int | None,
    model_type: str | None,
    original: int | None = None,
) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one RoPE parameter dict; llama3's original length ``original`` when
    given (a top-level key: transformers gives it priority), else the dict's, else
    ``max_position_embeddings``, as transformers sets it."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None

    def param(name: str) -> Any:
        if rope.get(name) is None:
            raise ValueError(
                f"rope type {rope_type!r} needs {name!r} in rope_scaling (or rope_parameters); "
                f"got {sorted(rope)}"
            )
        return rope[name]

    if rope_type == "linear":
        return theta, RopeScaling("linear", float(param("factor")))
    if rope_type == "llama3":
        if original is None:
            original = rope.get("original_max_position_embeddings", max_position_embeddings)
        if original is None:
            param("original_max_position_embeddings")
        return theta, RopeScaling(
            "llama3",
            factor=float(param("factor")),
            low_freq_factor=float(param("low_freq_factor")),
            high_freq_factor=float(param("high_freq_factor")),
            original_max_position_embeddings=int(original),  # type: ignore[arg-type]
        )
    raise ValueError(
        f"rope type {rope_type!r} of model_type {model_type!r} is not supported; expected 'default', 'linear' or 'llama3'"
    )


def _windows_from_hf(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers reads them for each model type."""
    num_layers = int(hf["num_hidden_layers"])
    if model_type == "mistral":  # one window for every layer (transformers ignores layer_types)
        window = hf.get("sliding_window")
        return {"sliding_window": int(window) if window else None, "layer_types": ()}
    if model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if not window:
            return {"sliding_window": None, "layer_types": ()}
        # transformers: layers from max_window_layers on slide, unless layer_types says otherwise
        types = hf.get("layer_types") or [
            SLIDING_ATTENTION if i >= int(hf.get("max_window_layers", 28)) else FULL_ATTENTION
            for i in range(num_layers)
        ]
        return {"sliding_window": int(window), "layer_types": tuple(types)}
    return {"sliding_window": None, "layer_types": ()}
