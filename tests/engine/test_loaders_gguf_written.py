"""GGUF files written here from the tiny HF checkpoints, as llama.cpp's converter lays them out
(Q/K rows permuted for "llama", rope_freqs for llama3 scaling, q/k norms for qwen3, tokenizer in
metadata): loading the GGUF must give the same model and tokenizer as loading the HF directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file

from engine.loaders import load_model
from engine.loaders.gguf_weights import unpermute_rows

from .conftest import TINY_CHAT_TEMPLATE, TINY_HF_CONFIGS, TINY_VOCAB, PagedKV

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rows [heads, 2, D/2] -> [heads, D/2, 2]."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for llama3 scaling (a divisor per frequency)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(
    hf_dir: Path,
    path: Path,
    arch: str,
    tokenizer_model: str = "gpt2",
    sliding_window: int | None = None,
    window_pattern: list[bool] | None = None,
) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg["rope_parameters"]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if window_pattern is not None:
        writer.add_sliding_window_pattern(window_pattern)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    # Pad to the model's vocab as converters do for ids without text.
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), cfg["vocab_size"])]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3 if t in specials else 1 if i < len(vocab) else 5 for i, t in enumerate(tokens)]
    )
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_factors(head_dim, rope["rope_theta"], rope)
        )
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, rows in ((9, 576), (3, 192), (2, 8)):
        for shape in ((rows, 5), (rows,)):
            w = rng.standard_normal(shape).astype(np.float32)
            assert not np.array_equal(llama_cpp_permute(w, heads), w)
            assert np.array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


@pytest.mark.parametrize(
    ("name", "arch"), [("llama3", "llama"), ("qwen3", "qwen3"), ("qwen2", "qwen2")]
)
def test_written_gguf_equals_hf_directory(
    name: str, arch: str, tiny_hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    hf_dir = tiny_hf_checkpoints[name]
    from_gguf = load_model(
        str(write_gguf(hf_dir, tmp_path / f"{name}.gguf", arch)), load_format="gguf"
    )
    from_hf = load_model(str(hf_dir))
    assert from_gguf.name == name
    hf_config = TINY_HF_CONFIGS[name]
    assert from_gguf.config.tie_word_embeddings == hf_config["tie_word_embeddings"]
    assert from_gguf.config.qk_norm == (arch == "qwen3")
    assert from_gguf.config.attention_bias == (arch == "qwen2")
    assert (from_gguf.config.rope_freq_factors is not None) == (name == "llama3")
    for (n1, p1), (n2, p2) in zip(
        from_gguf.model.named_parameters(), from_hf.model.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2), n1

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY_VOCAB, (13,), generator=gen).tolist()
    logits = []
    for loaded in (from_gguf, from_hf):
        kv = PagedKV.allocate(loaded.config, num_pages=5, page_size=4)
        batch = kv.batch([(ids, 0, [4, 1, 3, 2])])
        with torch.inference_mode():
            logits.append(loaded.model.compute_logits(loaded.model(batch, kv.layer_caches())))
    # Only the rope frequencies differ in the llama3 case (factors from the file vs the formula).
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)

    tok_gguf, tok_hf = from_gguf.tokenizer, from_hf.tokenizer
    assert tok_gguf is not None and tok_hf is not None
    for text in ["Hello world, the quick brown fox!", "naïve 日本語 😀 0123", "<|eot_id|>x"]:
        assert tok_gguf.encode(text) == tok_hf.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tok_gguf.apply_chat_template(messages) == tok_hf.apply_chat_template(messages)
    assert (tok_gguf.bos_token_id, tok_gguf.eos_token_id, tok_gguf.stop_token_ids) == (0, 1, (1, 4))


@pytest.mark.parametrize(
    ("name", "arch", "pattern"),
    [("qwen3_swa", "qwen3", [False, True, True]), ("mistral_swa", "llama", None)],
)
def test_gguf_sliding_window_key(
    name: str,
    arch: str,
    pattern: list[bool] | None,
    tiny_hybrid_checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    """``{arch}.attention.sliding_window`` (with a per-layer pattern, or for every layer) gives the
    windows of the HF directory, and the same logits over a sequence longer than the window."""
    hf_dir = tiny_hybrid_checkpoints[name]
    path = write_gguf(
        hf_dir, tmp_path / f"{name}.gguf", arch, sliding_window=32, window_pattern=pattern
    )
    from_gguf, from_hf = load_model(str(path)), load_model(str(hf_dir))
    layers = range(from_hf.config.num_layers)
    assert [from_gguf.config.layer_window(i) for i in layers] == [
        from_hf.config.layer_window(i) for i in layers
    ]
    assert any(from_hf.config.layer_window(i) == 32 for i in layers)
    ids = torch.randint(0, TINY_VOCAB, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = []
    for loaded in (from_gguf, from_hf):
        kv = PagedKV.allocate(loaded.config, num_pages=12, page_size=8)
        groups = sorted({loaded.config.kv_group(i) for i in layers})
        batch = kv.batch([(ids, 0, [4, 1, 3, 2, 9, 11, 5, 7, 6])], groups)
        with torch.inference_mode():
            logits.append(loaded.model.compute_logits(loaded.model(batch, kv.layer_caches())))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)


def test_sentencepiece_gguf_tokenizer_is_refused(
    tiny_hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(
        tiny_hf_checkpoints["qwen2"], tmp_path / "spm.gguf", "qwen2", tokenizer_model="llama"
    )
    with pytest.raises(
        ValueError, match="GGUF tokenizer model 'llama' is not supported; expected 'gpt2'"
    ):
        load_model(str(path))
