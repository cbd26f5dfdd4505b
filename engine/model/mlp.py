"""The SwiGLU feed-forward block of Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.linear import Linear, MergedLinear
from engine.model_config import ModelConfig


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up share one matmul (shards 0 and 1 of ``gate_up_proj``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, (size, size), bias=False, dtype=dtype)
        self.down_proj = Linear(size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)
