"""Tiny random checkpoints shaped for tensor parallelism: 8 query heads, 4 KV heads (Llama) and
8 query heads, 2 KV heads (Qwen3: tp 4 replicates each KV head on two ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import TINY_VOCAB, write_tiny_checkpoint

TP_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}


# A small engine over those checkpoints (LLM's keyword arguments).
SMALL_ENGINE: dict[str, Any] = {
    "page_size": 4,
    "num_pages": 64,
    "max_model_len": 64,
    "prefill_chunk_size": 16,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
}


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_tp")
    return {
        name: write_tiny_checkpoint(root / name, cfg, seed=20 + i)
        for i, (name, cfg) in enumerate(TP_HF_CONFIGS.items())
    }
