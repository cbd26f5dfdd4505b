"""ModelConfig from GGUF metadata (llama.cpp's ``{arch}.*`` and ``tokenizer.ggml.*`` keys)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from gguf.quants import dequantize

from engine.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeScaling,
)

# gemma3_text is not read from GGUF (llama.cpp stores its norms as 1 + w, among other changes).
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

_MISSING = object()


def gguf_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The decoded value of metadata ``key`` (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; expected one of {GGUF_ARCHITECTURES}"
        )
    return arch


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    arch = gguf_architecture(reader)

    def key(name: str, default: Any = _MISSING) -> Any:
        return gguf_field(reader, f"{arch}.{name}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(key("attention.head_count"))
    hidden_size = int(key("embedding_length"))
    # key_length is written when head_dim != hidden/heads; llama files give rope.dimension_count instead.
    head_dim = int(
        key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden_size // num_heads
    )
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", None)
    vocab_size = int(key("vocab_size", 0) or (len(tokens) if tokens else 0))
    if vocab_size == 0:
        raise ValueError(
            f"GGUF file states no vocab size (neither {arch}.vocab_size nor tokenizer.ggml.tokens)"
        )
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id", None)
    has_qkv_bias = "blk.0.attn_q.bias" in tensor_names
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        rope_freq_factors=_rope_freq_factors(reader),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_qkv_bias,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **_windows(reader, arch, int(key("block_count"))),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _windows(reader: GGUFReader, arch: str, num_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` from ``{arch}.attention.sliding_window`` and, when
    present, ``{arch}.attention.sliding_window_pattern`` (a bool per layer, true = sliding; or an
    int N: every Nth layer full, as llama.cpp reads it); a window without a pattern covers every
    layer."""
    window = gguf_field(reader, f"{arch}.attention.sliding_window", None)
    if not window:
        return {"sliding_window": None, "layer_types": ()}
    pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern", None)
    if pattern is None:
        return {"sliding_window": int(window), "layer_types": ()}
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                f"{num_layers} layers"
            )
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    types = tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding)
    return {"sliding_window": int(window), "layer_types": types}


def _rope_scaling(reader: GGUFReader, arch: str) -> RopeScaling | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(gguf_field(reader, f"{arch}.rope.scaling.factor")))
    raise ValueError(
        f"GGUF rope scaling type {kind!r} is not supported; expected 'none' or 'linear'"
    )


def _rope_freq_factors(reader: GGUFReader) -> tuple[float, ...] | None:
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return tuple(float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1))
    return None
