"""Rotary embeddings against transformers' LlamaRotaryEmbedding for default, linear and llama3 scaling."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model import RotaryEmbedding, apply_rotary, rope_inv_freq
from engine.model_config import ModelConfig

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 128,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
}
SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cos_sin_and_rotation_match_transformers(kind: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_dict = {**BASE, "rope_scaling": SCALINGS[kind]}
    config = ModelConfig.from_hf_config(hf_dict)
    hf_rope = LlamaRotaryEmbedding(
        LlamaConfig(**{k: v for k, v in hf_dict.items() if k != "model_type"})
    )
    positions = torch.tensor([0, 1, 7, 300, 4000])
    x = torch.randn(1, 4, 5, 32)  # [batch, heads, T, D] as transformers lays it out
    hf_cos, hf_sin = hf_rope(x, positions[None])
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    hf_q, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    ours = apply_rotary(x[0].transpose(0, 1), cos, sin)  # [T, H, D]
    torch.testing.assert_close(ours, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_scalings_change_only_the_bands_they_should() -> None:
    default = rope_inv_freq(ModelConfig.from_hf_config({**BASE, "rope_scaling": None}))
    llama3 = rope_inv_freq(ModelConfig.from_hf_config({**BASE, "rope_scaling": SCALINGS["llama3"]}))
    wavelen = 2 * torch.pi / default
    assert torch.equal(
        llama3[wavelen < 256 / 4], default[wavelen < 256 / 4]
    )  # high frequencies kept
    torch.testing.assert_close(
        llama3[wavelen > 256], default[wavelen > 256] / 8
    )  # low ones stretched
    medium = (wavelen >= 64) & (wavelen <= 256)
    assert medium.any()
    assert ((llama3[medium] < default[medium]) & (llama3[medium] > default[medium] / 8)).all()


def test_freq_factors_divide_the_frequencies() -> None:
    plain = ModelConfig.from_hf_config(BASE)
    factors = tuple(float(i + 1) for i in range(plain.head_dim // 2))
    scaled = ModelConfig.from_dict({**plain.__dict__, "rope_freq_factors": factors})
    torch.testing.assert_close(rope_inv_freq(scaled), rope_inv_freq(plain) / torch.tensor(factors))
