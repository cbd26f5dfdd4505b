"""ModelConfig from a Gemma 3 text ``config.json`` (``gemma3_text``, ``Gemma3ForCausalLM``).

Read as transformers' Gemma3TextConfig reads it (its defaults for absent keys; transformers 5's
nested ``rope_parameters`` or the older ``rope_theta``/``rope_local_base_freq``/``rope_scaling``;
``layer_types`` or the older ``sliding_window_pattern``). Fields this engine does not implement are
refused by name rather than ignored, and so is any key it does not know.
"""

from __future__ import annotations

from typing import Any

from engine.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    _as_id_tuple,
    rope_from_params,
)

# transformers' Gemma3TextConfig defaults
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0
_SLIDING_WINDOW_PATTERN = 6  # every 6th layer full, as transformers assumes without layer_types

_READ = set(_DEFAULTS) | {
    "model_type",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "rope_local_base_freq",
    "layer_types",
    "sliding_window_pattern",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
}
# Keys that change nothing at inference (or that transformers' Gemma 3 does not read).
_INERT = {
    "architectures",
    "attention_dropout",
    "cache_implementation",
    "initializer_range",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "_name_or_path",
    "hidden_act",  # transformers' Gemma 3 reads hidden_activation
    "_sliding_window_pattern",  # (it reads sliding_window_pattern only)
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}


def gemma3_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a ``gemma3_text`` config dict; ValueError names any field not supported."""
    unknown = sorted(set(hf) - _READ - _INERT)
    if unknown:
        raise ValueError(
            f"gemma3_text config fields {unknown} are not supported (this loader implements "
            f"{sorted(_READ - {'model_type'})} and ignores {sorted(_INERT)})"
        )
    get = {**_DEFAULTS, **hf}
    if get["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(
            f"gemma3_text hidden_activation {get['hidden_activation']!r} is not supported; "
            "expected 'gelu_pytorch_tanh'"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text with use_bidirectional_attention=True is not supported")
    if hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma3Attention stores it but never applies it, and the published Gemma 3
        # configs leave it null: applying it would disagree with the reference, ignoring it would
        # be a setting accepted and dropped.
        raise ValueError(
            "gemma3_text attn_logit_softcapping is not supported: transformers' Gemma 3 does not "
            "apply it (Gemma 3 configs set it to null)"
        )
    num_layers = int(get["num_hidden_layers"])
    window = get["sliding_window"]
    full, local = _rope_params(hf)
    rope_theta, rope_scaling = rope_from_params(
        full, float(full["rope_theta"]), int(get["max_position_embeddings"]), "gemma3_text"
    )
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(
            f"gemma3_text rope type {local_type!r} for sliding_attention layers is not supported; "
            "expected 'default'"
        )
    return ModelConfig(
        architecture="gemma3_text",
        vocab_size=int(get["vocab_size"]),
        hidden_size=int(get["hidden_size"]),
        num_layers=num_layers,
        num_heads=int(get["num_attention_heads"]),
        num_kv_heads=int(get["num_key_value_heads"]),
        head_dim=int(get["head_dim"]),
        intermediate_size=int(get["intermediate_size"]),
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=float(get["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_local_theta=float(local["rope_theta"]),
        max_position_embeddings=int(get["max_position_embeddings"]),
        tie_word_embeddings=bool(get["tie_word_embeddings"]),
        attention_bias=bool(get["attention_bias"]),
        attention_out_bias=bool(get["attention_bias"]),
        qk_norm=True,
        sliding_window=int(window) if window is not None else None,
        layer_types=_layer_types(hf, num_layers) if window is not None else (),
        query_pre_attn_scalar=float(get["query_pre_attn_scalar"]),
        final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
        bos_token_id=get["bos_token_id"],
        eos_token_ids=_as_id_tuple(get["eos_token_id"]),
    )


def _rope_params(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) RoPE parameters, as transformers' Gemma3TextConfig
    reads them: ``rope_parameters`` (else default RoPE for both), ``rope_scaling`` merged into the
    full-attention entry, the thetas each entry lacks from ``rope_theta`` and
    ``rope_local_base_freq`` (else 1e6 and 1e4)."""
    params = hf.get("rope_parameters")
    if params is not None and (
        not isinstance(params, dict) or not set(params) <= {FULL_ATTENTION, SLIDING_ATTENTION}
    ):
        raise ValueError(
            "gemma3_text rope_parameters must map 'full_attention' and 'sliding_attention' to "
            f"their parameters, got {params!r}"
        )
    params = params or {}
    full = dict(params.get(FULL_ATTENTION) or {"rope_type": "default"})
    local = dict(params.get(SLIDING_ATTENTION) or {"rope_type": "default"})
    if hf.get("rope_scaling") is not None:
        full.update(hf["rope_scaling"])
    for entry, key, default in [
        (full, "rope_theta", _GLOBAL_THETA),
        (local, "rope_local_base_freq", _LOCAL_THETA),
    ]:
        if entry.get("rope_theta") is None:
            entry["rope_theta"] = default if hf.get(key) is None else hf[key]
    return full, local


def _layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern") or _SLIDING_WINDOW_PATTERN)
    return tuple(
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
