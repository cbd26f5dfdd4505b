"""The gated feed-forward block: SwiGLU (Llama family) or GeGLU with tanh GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from duet_kernels import silu_and_mul
from engine.model.linear import MergedLinear, RowParallelLinear
from engine.model_config import ModelConfig
from engine.tp.context import TPContext


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, act = silu or tanh-approximated GELU (``config.hidden_act``);
    gate and up share one matmul (shards 0 and 1 of ``gate_up_proj``)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        # With tensor parallelism: this rank's columns of gate/up, rows of down (summed over ranks).
        size = config.intermediate_size if tp is None else tp.partition.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = MergedLinear(config.hidden_size, (size, size), bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, dtype=dtype, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if not self.gelu:  # one fused kernel on a GPU
            return self.down_proj(silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1])))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
