"""LlamaForCausalLM: the Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model.causal_lm import PagedCausalLMBase
from engine.model.decoder_layer import DecoderLayer
from engine.model.linear import Linear
from engine.model.norm import RMSNorm
from engine.model.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.tp.context import TPContext


class LlamaModel(nn.Module):
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
            DecoderLayer(config, layer, dtype=dtype, tp=tp) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(PagedCausalLMBase):
    """The model as the engine runs it: ``forward`` fills the KV pages and returns hidden states,
    ``compute_logits`` (engine/model/causal_lm.py) turns the rows to sample into float32 logits.
    With tied embeddings there is no ``lm_head`` module: the logits reuse
    ``model.embed_tokens.weight``.
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, dtype=dtype, tp=tp)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step over ``batch``; returns the final-norm hidden states [T, hidden].

        ``kv_caches[i]`` is layer i's (k_cache, v_cache), each [num_pages, page_size, Hkv, head_dim]
        (``kv_buffer.layer_view(buffer, j)`` of its pool group's layout, kvcache/spec.py). The
        new tokens' K/V are written to the slots of each layer's group (``batch.slot_mappings``)
        before attention reads the pages.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"got {len(kv_caches)} layer caches for a model of {self.config.num_layers} layers"
            )
        hidden = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(batch.positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, batch, kv_cache)
        return self.model.norm.add_forward(hidden, residual)[0]
