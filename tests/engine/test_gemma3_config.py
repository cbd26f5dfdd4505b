"""ModelConfig from Gemma 3 text configs: both spellings of RoPE and layer pattern, transformers'
defaults, and refusals that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from engine.model_config import ModelConfig, RopeScaling

GEMMA3_1B: dict[str, Any] = {  # google/gemma-3-1b-it config.json (transformers 4.50 spelling)
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_gemma3_1b() -> None:
    c = ModelConfig.from_hf_config(GEMMA3_1B)
    assert (c.architecture, c.num_layers, c.head_dim, c.hidden_act) == (
        "gemma3_text",
        26,
        256,
        "gelu_pytorch_tanh",
    )
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.attention_scale == 256**-0.5 and c.qk_norm and c.tie_word_embeddings
    assert c.eos_token_ids == (1, 106) and c.final_logit_softcapping is None
    windows = [c.layer_window(i) for i in range(26)]
    assert windows.count(None) == 4 and windows[5] is None and windows[4] == 512  # 5:1
    assert {c.kv_group(i) for i in range(26)} == {"full", "swa_512"}


def test_transformers_5_spelling_and_scaling() -> None:
    hf = {
        k: v
        for k, v in GEMMA3_1B.items()
        if k not in ("rope_local_base_freq", "rope_theta", "rope_scaling", "sliding_window_pattern")
    }
    hf["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},
    }
    hf["layer_types"] = ["sliding_attention", "full_attention"] * 13
    hf["final_logit_softcapping"] = 30.0
    c = ModelConfig.from_hf_config(hf)
    assert (c.rope_theta, c.rope_local_theta) == (500000.0, 20000.0)
    assert c.rope_scaling == RopeScaling("linear", 8.0)
    assert c.layer_window(0) == 512 and c.layer_window(1) is None
    assert c.final_logit_softcapping == 30.0


def test_absent_keys_take_transformers_defaults() -> None:
    c = ModelConfig.from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 7})
    assert (c.hidden_size, c.head_dim, c.sliding_window, c.rope_local_theta) == (
        2304,
        256,
        4096,
        10000.0,
    )
    assert [c.layer_window(i) is None for i in range(7)] == [False] * 5 + [True, False]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"\['quantization_config'\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"model_type": "gemma3"}, "multimodal"),
    ],
)
def test_unsupported_fields_fail_naming_them(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**GEMMA3_1B, **change})
