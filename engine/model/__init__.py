"""The Llama-family model in small pieces; ``LlamaForCausalLM`` is what the engine runs."""

from engine.model.attention import PagedAttention
from engine.model.decoder_layer import DecoderLayer
from engine.model.linear import MergedLinear
from engine.model.llama import LlamaForCausalLM, LlamaModel
from engine.model.mlp import SwiGLUMLP
from engine.model.norm import RMSNorm
from engine.model.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "DecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "MergedLinear",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "apply_rotary",
    "rope_inv_freq",
]
