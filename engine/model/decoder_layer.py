"""One pre-norm transformer block: attention then the gated MLP, each with a residual connection.

The residual stream travels beside the hidden states (vLLM's layout): each norm adds the previous
block's output to the stream and normalises the sum in one kernel. Addition commutes exactly, so
the sums are bit for bit transformers' ``hidden + block(hidden)``.
"""

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
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # the stream before that output; None for the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the stream before it); the next norm adds the two."""
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(normed, cos, sin, batch, kv_cache)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual
