"""One pre-norm transformer block: attention then the gated MLP, each with a residual connection."""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model.attention import PagedAttention
from engine.model.mlp import GatedMLP
from engine.model.norm import RMSNorm
from engine.model_config import ModelConfig
from engine.tp.context import TPContext


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype | None = None,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = PagedAttention(
            config,
            dtype=dtype,
            sliding_window=config.layer_window(layer),
            kv_group=config.kv_group(layer),
            softcap=config.attn_logit_softcapping,
            tp=tp,
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )
        self.mlp = GatedMLP(config, dtype=dtype, tp=tp)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, batch, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
