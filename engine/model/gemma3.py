"""Gemma3ForCausalLM: Gemma 3's text decoder over the paged KV cache.

What differs from the Llama family (checked against transformers' modeling_gemma3.py): RMSNorm scales
by (1 + w) and rounds once at the end; each layer has four norms (before and after attention, before
and after the MLP, the "after" ones applied to the block's output before the residual add); the
embeddings are scaled by sqrt(hidden_size) (rounded to the weights' dtype); the MLP is GeGLU with
tanh GELU; queries and keys are RMS-normed per head before RoPE; sliding-window layers use RoPE of a
local base without scaling, full layers the global base with the config's scaling; scores are
scaled by query_pre_attn_scalar ** -0.5; logits may be soft-capped (``final_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model.attention import PagedAttention
from engine.model.causal_lm import PagedCausalLMBase
from engine.model.linear import Linear
from engine.model.mlp import GatedMLP
from engine.model.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.tp.context import TPContext


class Gemma3RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in float32, rounded to x's dtype at the end
    (weights are stored as offsets from 1, so a zero weight is the identity scale)."""

    identity_weight = 0.0  # the weight that leaves the normalized input unscaled (dummy init)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype | None = None,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.sliding = config.layer_window(layer) is not None
        self.self_attn = PagedAttention(
            config,
            dtype=dtype,
            sliding_window=config.layer_window(layer),
            kv_group=config.kv_group(layer),
            softcap=config.attn_logit_softcapping,
            tp=tp,
        )
        # Gemma's q/k norms are (1 + w) norms too.
        self.self_attn.q_norm = Gemma3RMSNorm(config.head_dim, eps, dtype=dtype)
        self.self_attn.k_norm = Gemma3RMSNorm(config.head_dim, eps, dtype=dtype)
        self.mlp = GatedMLP(config, dtype=dtype, tp=tp)
        self.input_layernorm = Gemma3RMSNorm(size, eps, dtype=dtype)
        self.post_attention_layernorm = Gemma3RMSNorm(size, eps, dtype=dtype)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(size, eps, dtype=dtype)
        self.post_feedforward_layernorm = Gemma3RMSNorm(size, eps, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, batch, kv_cache)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of HF parameter names)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        # Created without its random init (N(0,1) over the whole vocab is slow and always overwritten).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, layer, dtype=dtype, tp=tp)
            for layer in range(config.num_layers)
        )
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class Gemma3ForCausalLM(PagedCausalLMBase):
    """Gemma 3's text model as the engine runs it (same interface as LlamaForCausalLM)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        if config.architecture != "gemma3_text":
            raise ValueError(
                f"Gemma3ForCausalLM needs a gemma3_text config, got {config.architecture!r}"
            )
        self.config = config
        self.tp = tp
        self.model = Gemma3Model(config, dtype=dtype, tp=tp)
        self.embed_scale = config.hidden_size**0.5
        self.rotary_global = RotaryEmbedding(config)
        local_theta = config.rope_local_theta or config.rope_theta
        local = dataclasses.replace(config, rope_theta=local_theta, rope_scaling=None)
        self.rotary_local = RotaryEmbedding(local)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step over ``batch``; returns the final-norm hidden states [T, hidden]
        (``kv_caches`` as in LlamaForCausalLM.forward)."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"got {len(kv_caches)} layer caches for a model of {self.config.num_layers} layers"
            )
        embed = self.model.embed_tokens
        # transformers multiplies by the scale as a float32 tensor cast to the weights' dtype; the
        # same rounded value as a Python scalar multiplies alike, and makes no host-to-device
        # copy (which a CUDA graph capture refuses)
        scale = float(torch.tensor(self.embed_scale).to(embed.weight.dtype))
        hidden = embed(batch.input_ids) * scale  # [T, hidden]
        rope = {
            True: self.rotary_local(batch.positions, hidden.dtype),
            False: self.rotary_global(batch.positions, hidden.dtype),
        }
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            cos, sin = rope[layer.sliding]
            hidden = layer(hidden, cos, sin, batch, kv_cache)
        return self.model.norm(hidden)
