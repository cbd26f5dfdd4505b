"""ModelConfig.from_hf_config reads a config.json as transformers does, where the two spellings of
RoPE meet or keys are left out: each case is read by transformers' AutoConfig too, and the values
that decide the model's output (RoPE theta and scaling per layer type, windows, head counts,
lengths) must agree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling

BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _hf(tmp_path: Path, config: dict[str, Any]) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    hf.standardize_rope_params()  # (as each RoPE init of transformers' models does first)
    return hf


def _scaling(rope: dict[str, Any]) -> RopeScaling | None:
    """transformers' standardised RoPE entry as the RopeScaling it means."""
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    return RopeScaling(
        "llama3",
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


FLAT_CASES = {
    # transformers 5 writes rope_parameters; a rope_scaling added by hand replaces it whole, its
    # theta included (the top-level rope_theta or the default then)
    "both spellings": {
        "model_type": "llama",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "both spellings, top-level theta": {
        "model_type": "qwen3",
        "head_dim": 16,
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    # a top-level original length wins over the dict's; without either, max_position_embeddings
    "llama3, top-level original length": {
        "model_type": "llama",
        "original_max_position_embeddings": 32,
        "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 4096},
    },
    "llama3, no original length": {"model_type": "llama", "rope_scaling": LLAMA3},
    # keys left out take each type's defaults
    "qwen3, defaults": {
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "use_sliding_window": True,
        "max_window_layers": 2,
        "max_position_embeddings": None,
    },
    "mistral, no window key": {
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_key_value_heads": None,
    },
    "qwen2, no KV heads key": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 64,
    },
}


@pytest.mark.parametrize("case", FLAT_CASES)
def test_flat_rope_windows_and_defaults_as_transformers_reads_them(
    case: str, tmp_path: Path
) -> None:
    config = {**BASE, **FLAT_CASES[case]}
    config = {k: v for k, v in config.items() if v is not None}  # None: the key left out
    ours = ModelConfig.from_hf_config(config)
    hf = _hf(tmp_path, config)
    assert ours.rope_theta == float(hf.rope_parameters["rope_theta"])
    assert ours.rope_scaling == _scaling(hf.rope_parameters)
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    )
    assert ours.max_position_embeddings == hf.max_position_embeddings
    window = getattr(hf, "sliding_window", None)
    assert ours.sliding_window == window
    if window is not None and getattr(hf, "layer_types", None):
        assert [ours.layer_window(i) for i in range(ours.num_layers)] == [
            window if t == SLIDING_ATTENTION else None for t in hf.layer_types
        ]


GEMMA = {
    **BASE,
    "model_type": "gemma3_text",
    "head_dim": 16,
    "num_hidden_layers": 6,
    "sliding_window": 8,
    "query_pre_attn_scalar": 16,
}
GEMMA_CASES = {
    "rope_scaling merged into rope_parameters": {
        "rope_parameters": {
            FULL_ATTENTION: {"rope_type": "default", "rope_theta": 1e6},
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 1e4},
        },
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "local theta from rope_local_base_freq": {
        "rope_parameters": {FULL_ATTENTION: {"rope_type": "default", "rope_theta": 1e6}},
        "rope_local_base_freq": 100.0,
    },
    "llama3 on global layers, no original length": {
        "rope_parameters": {FULL_ATTENTION: LLAMA3, SLIDING_ATTENTION: {"rope_type": "default"}}
    },
    "the private pattern key is not read": {"_sliding_window_pattern": 2},
    "the public pattern key is": {"sliding_window_pattern": 2},
}


@pytest.mark.parametrize("case", GEMMA_CASES)
def test_gemma3_rope_and_layers_as_transformers_reads_them(case: str, tmp_path: Path) -> None:
    config = {**GEMMA, **GEMMA_CASES[case]}
    ours = ModelConfig.from_hf_config(config)
    hf = _hf(tmp_path, config)
    full, local = hf.rope_parameters[FULL_ATTENTION], hf.rope_parameters[SLIDING_ATTENTION]
    assert ours.rope_theta == float(full["rope_theta"])
    assert ours.rope_scaling == _scaling(full)
    assert ours.rope_local_theta == float(local["rope_theta"])
    assert local["rope_type"] == "default"
    assert ours.layer_types == tuple(hf.layer_types)
