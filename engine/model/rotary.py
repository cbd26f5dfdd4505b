"""Rotary position embeddings (the "rotate half" layout of HF checkpoints), with llama3/linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The head_dim/2 inverse frequencies in float32, on the CPU, scaled as the config says."""
    dim = config.head_dim
    # Same arithmetic as transformers (int64 arange cast to float32), so the frequencies match bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(
            inv_freq,
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position_embeddings,
        )
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(
            config.rope_freq_factors, dtype=torch.float32, device="cpu"
        )
    return inv_freq


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, original_len: int
) -> torch.Tensor:
    # Long wavelengths (beyond the original context / low) are stretched by `factor`, short ones
    # (below original / high) are kept, and the band between blends the two linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    stretched = torch.where(long_wave, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    return torch.where(~long_wave & ~short_wave, blended, stretched)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for the positions of one step; shared by all layers of a model."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in place (after the module was materialised from the meta device)."""
        self.inv_freq.copy_(rope_inv_freq(self.config))

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the per-token tables cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
