"""Seeded random weights for any ModelConfig (benchmarks of large shapes without a checkpoint)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from engine.model_config import ModelConfig, RopeScaling

_LLAMA3_8B = ModelConfig(
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
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)

DUMMY_PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "llama-3-8b": _LLAMA3_8B,
        "llama-3.1-8b": ModelConfig(
            **{
                **_LLAMA3_8B.__dict__,
                "max_position_embeddings": 131072,
                "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
            }
        ),
        "qwen3-8b": ModelConfig(
            architecture="qwen3",
            vocab_size=151936,
            hidden_size=4096,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            qk_norm=True,
            bos_token_id=151643,
            eos_token_ids=(151645,),
        ),
    }
)
"""Named shapes for ``load_model(name, load_format="dummy")``; the values of the public configs."""

DUMMY_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Fill every parameter deterministically from ``seed``: norm weights the identity scale (1, or
    0 for Gemma's (1 + w) norms), everything else N(0, std).

    A small std keeps the residual stream and the logits finite at any depth. Values depend on the
    seed and the device (CPU and CUDA generators differ), not on anything else.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        identity = getattr(model.get_submodule(owner), "identity_weight", None)
        if identity is not None and attr == "weight":
            param.fill_(identity)
        else:
            param.normal_(0.0, std, generator=generator)
