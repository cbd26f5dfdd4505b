"""GGUF tensors as HF-named float tensors: dequantize, rename, and undo llama.cpp's Q/K row permutation."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.model_config import ModelConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors that carry no parameter: rope_freqs is read into ModelConfig.rope_freq_factors instead.
_SKIPPED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for tensors without a parameter."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model")


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of Q/K rows for rotary.

    convert_hf_to_gguf.py reorders each head's rows from HF's "rotate half" layout (first half, then
    second half of the rotary pairs) to interleaved pairs: rows viewed as [heads, 2, D/2] become
    [heads, D/2, 2]. Viewing the file's rows as [heads, D/2, 2] and swapping back restores HF order.
    """
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weights.shape)


def iter_gguf_weights(
    reader: GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every parameter tensor of the file, in file order."""
    # Only llama.cpp's "llama" architecture permutes; its qwen2/qwen3 converters keep HF order.
    permuted = config.architecture in ("llama", "mistral")
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)  # HF order: [out, in]
        if permuted and ".self_attn.q_proj." in name:
            weights = unpermute_rows(weights, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weights = unpermute_rows(weights, config.num_kv_heads)
        yield name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
