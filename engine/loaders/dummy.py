"""Seeded random weights for any ModelConfig (benchmarks of large shapes without a checkpoint)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from engine.model_config import ModelConfig, RopeScaling

if TYPE_CHECKING:
    from engine.model.causal_lm import PagedCausalLMBase

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
def init_dummy_weights(model: PagedCausalLMBase, seed: int, std: float = DUMMY_STD) -> None:
    """Fill every parameter deterministically from ``seed``: norm weights the identity scale (1, or
    0 for Gemma's (1 + w) norms), everything else N(0, std).

    Each checkpoint tensor (HF name, whole shape) is drawn from its own generator, seeded from
    ``seed`` and its name, then cut to the rank's part: every tensor-parallel size gets the same
    model, so prefill and decode workers of different sizes agree. A small std keeps the residual
    stream and the logits finite at any depth. Values depend on the seed and the device (CPU and
    CUDA generators differ), not on anything else.
    """
    param = next(model.parameters())
    model.load_weights(_dummy_tensors(model, seed, std, param.dtype, param.device))


def _dummy_tensors(
    model: PagedCausalLMBase, seed: int, std: float, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, identity in model.checkpoint_tensors():
        if identity is not None:
            yield name, torch.full(shape, identity, dtype=dtype, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(
            (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        )
        tensor = torch.empty(shape, dtype=dtype, device=device)
        yield name, tensor.normal_(0.0, std, generator=generator)
