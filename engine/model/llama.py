"""LlamaForCausalLM: the Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model.decoder_layer import DecoderLayer
from engine.model.linear import Linear, MergedLinear, PackedWeight
from engine.model.norm import RMSNorm
from engine.model.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from kernels import linear

# HF projection name -> (merged module, shard index); the checkpoint keeps them apart, we stack them.
_STACKED: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_STACKED_NAME = re.compile(
    r"^(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$"
)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of HF parameter names)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # Created without its random init (N(0,1) over the whole vocab is slow and always overwritten).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """The model as the engine runs it: ``forward`` fills the KV pages and returns hidden states,
    ``compute_logits`` turns the rows to sample into float32 logits.

    Parameter names follow HF checkpoints except for the stacked ``qkv_proj`` and ``gate_up_proj``;
    ``load_weights`` takes HF names. With tied embeddings there is no ``lm_head`` module: the
    logits reuse ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head: Linear | None = None
        self.tied_lm_head = PackedWeight()  # the embedding in kernels.linear's layout, when tied
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    @classmethod
    def build(
        cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> LlamaForCausalLM:
        """An instance with uninitialised parameters on ``device`` (skips the random init that a
        checkpoint overwrites anyway); fill it with ``load_weights`` or engine/loaders/dummy.py."""
        with torch.device("meta"):
            model = cls(config, dtype=dtype)
        model.to_empty(device=device)
        model.rotary_emb.reset_buffers()
        return model.eval()

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run one step over ``batch``; returns the final-norm hidden states [T, hidden].

        ``kv_caches[i]`` is layer i's (k_cache, v_cache), each [num_pages, page_size, Hkv, head_dim]
        (``buffer[:, i, 0]`` / ``buffer[:, i, 1]`` of the kvcache/spec.py layout). The new tokens' K/V
        are written to ``batch.slot_mapping`` before attention reads the pages.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"got {len(kv_caches)} layer caches for a model of {self.config.num_layers} layers"
            )
        hidden = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(batch.positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, batch, kv_cache)
        return self.model.norm(hidden)

    def compute_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden] -> float32 logits [S, vocab] of the rows ``logits_indices`` (all rows if None)."""
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        weight = self.model.embed_tokens.weight
        return linear(hidden, weight, packed=self.tied_lm_head.get(weight)).float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> None:
        """Copy HF-named tensors into the parameters (converting dtype and device).

        Unknown names raise ValueError; with ``strict`` so does any parameter left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, stored by some old checkpoints
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            match = _STACKED_NAME.match(name)
            if match:
                prefix, proj, kind = match.groups()
                module_name, shard = _STACKED[proj]
                module = self.get_submodule(f"{prefix}.{module_name}")
                assert isinstance(module, MergedLinear)
                module.load_shard(shard, kind, tensor)
                loaded.add((f"{prefix}.{module_name}.{kind}", shard))
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__} ({self.config.architecture})"
                )
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add((name, 0))
        if strict:
            missing = [
                name for name, shard in self._expected_shards() if (name, shard) not in loaded
            ]
            if missing:
                raise ValueError(
                    f"{len(missing)} parameters missing from the checkpoint, e.g. {sorted(set(missing))[:5]}"
                )

    def _expected_shards(self) -> list[tuple[str, int]]:
        expected: list[tuple[str, int]] = []
        for module_name, module in self.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
                expected.extend((full, shard) for shard in range(shards))
        return expected
