"""ModelConfig.from_hf_config for each supported model_type, both rope spellings, and its errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.model_config import ModelConfig, RopeScaling

LLAMA31_8B: dict[str, Any] = {  # the public config.json, transformers 4 spelling
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_llama31_legacy_spelling() -> None:
    config = ModelConfig.from_hf_config(LLAMA31_8B)
    assert config == ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    )
    assert (config.q_size, config.kv_size) == (4096, 1024)


def test_transformers5_rope_parameters_and_linear_scaling() -> None:
    hf = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == RopeScaling("linear", 2.0)
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 7.0}
    assert ModelConfig.from_hf_config(hf).rope_scaling is None


def test_qwen2_bias_qwen3_norm_mistral_window() -> None:
    base = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    qwen2 = ModelConfig.from_hf_config({**base, "model_type": "qwen2", "eos_token_id": 7})
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    assert qwen2.eos_token_ids == (7,)
    qwen3 = ModelConfig.from_hf_config(
        {**base, "model_type": "qwen3", "head_dim": 32, "attention_bias": False}
    )
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.q_size, qwen3.attention_bias) == (
        True,
        32,
        128,
        False,
    )
    mistral = ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 4096})
    assert (mistral.sliding_window, mistral.attention_bias, mistral.head_dim) == (4096, False, 16)
    llama_bias = ModelConfig.from_hf_config({**base, "model_type": "llama", "attention_bias": True})
    assert (llama_bias.attention_bias, llama_bias.attention_out_bias) == (True, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"num_key_value_heads": 3}, r"num_heads \(32\) must be a multiple of num_kv_heads \(3\)"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_errors_name_the_problem(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**LLAMA31_8B, **change})


def test_windows_per_layer_as_transformers_reads_them() -> None:
    base = {**LLAMA31_8B, "num_hidden_layers": 4, "sliding_window": 64}
    qwen = ModelConfig.from_hf_config(
        {**base, "model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 1}
    )
    # layers from max_window_layers on slide (transformers' Qwen2/Qwen3 configs)
    assert [qwen.layer_window(i) for i in range(4)] == [None, 64, 64, 64]
    assert [qwen.kv_group(i) for i in range(4)] == ["full", "swa_64", "swa_64", "swa_64"]
    explicit = ModelConfig.from_hf_config(
        {
            **base,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        }
    )
    assert [explicit.layer_window(i) for i in range(4)] == [64, None, 64, None]
    # use_sliding_window False: no window at all, whatever sliding_window says
    off = ModelConfig.from_hf_config({**base, "model_type": "qwen3"})
    assert off.sliding_window is None and off.kv_group(3) == "full"
    mistral = ModelConfig.from_hf_config({**base, "model_type": "mistral"})
    assert {mistral.kv_group(i) for i in range(4)} == {"swa_64"}  # one window, every layer
    llama = ModelConfig.from_hf_config(base)  # transformers' Llama has no window
    assert llama.sliding_window is None and llama.attention_types == ("full_attention",) * 4


def test_layer_types_are_checked() -> None:
    base = dataclasses.asdict(ModelConfig.from_hf_config({**LLAMA31_8B, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="2 layers"):
        ModelConfig.from_dict({**base, "sliding_window": 8, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="'local'"):
        ModelConfig.from_dict({**base, "sliding_window": 8, "layer_types": ["local"] * 2})
    with pytest.raises(ValueError, match="'gemma3_text' only"):
        ModelConfig.from_dict({**base, "rope_local_theta": 10000.0})


def test_frozen_and_dict_round_trip() -> None:
    config = ModelConfig.from_hf_config(LLAMA31_8B)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 1  # type: ignore[misc]
    assert ModelConfig.from_dict(dataclasses.asdict(config)) == config
    with pytest.raises(ValueError, match="unknown ModelConfig fields \\['layers'\\]"):
        ModelConfig.from_dict({**dataclasses.asdict(config), "layers": 3})
