"""The decoder models in small pieces: ``LlamaForCausalLM`` (the Llama family) and
``Gemma3ForCausalLM``; ``model_class`` picks the one a config needs."""

from engine.model.attention import PagedAttention
from engine.model.causal_lm import PagedCausalLMBase
from engine.model.decoder_layer import DecoderLayer
from engine.model.gemma3 import Gemma3ForCausalLM, Gemma3RMSNorm
from engine.model.linear import MergedLinear
from engine.model.llama import LlamaForCausalLM, LlamaModel
from engine.model.mlp import GatedMLP
from engine.model.norm import RMSNorm
from engine.model.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from engine.model_config import ModelConfig


def model_class(config: ModelConfig) -> type[PagedCausalLMBase]:
    """The model class that implements ``config.architecture``."""
    return Gemma3ForCausalLM if config.architecture == "gemma3_text" else LlamaForCausalLM


__all__ = [
    "DecoderLayer",
    "GatedMLP",
    "Gemma3ForCausalLM",
    "Gemma3RMSNorm",
    "LlamaForCausalLM",
    "LlamaModel",
    "MergedLinear",
    "PagedAttention",
    "PagedCausalLMBase",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "model_class",
    "rope_inv_freq",
]
