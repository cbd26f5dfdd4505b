"""The embedded GGUF through our loader against transformers' load of the same file."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.loaders import LoadedModel
from engine.loaders.gguf_weights import hf_name


def test_config_matches_transformers(default_model: LoadedModel, hf_gguf_model: Any) -> None:
    hf = hf_gguf_model.config
    config = default_model.config
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert (config.architecture, config.vocab_size, config.hidden_size, config.num_layers) == (
        "llama",
        49152,
        576,
        30,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        9,
        3,
        64,
        1536,
    )
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_scaling is None and config.rope_freq_factors is None
    assert (config.max_position_embeddings, config.tie_word_embeddings) == (
        hf.max_position_embeddings,
        hf.tie_word_embeddings,
    )
    assert (config.bos_token_id, config.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))


def test_weights_equal_transformers(default_model: LoadedModel, hf_gguf_model: Any) -> None:
    ours = dict(default_model.model.named_parameters())
    theirs = dict(hf_gguf_model.named_parameters())
    for layer in (0, 17, 29):
        prefix = f"model.layers.{layer}"
        qkv = torch.cat([theirs[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(ours[f"{prefix}.self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([theirs[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(ours[f"{prefix}.mlp.gate_up_proj.weight"], gate_up)
        for name in (
            "self_attn.o_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ):
            assert torch.equal(ours[f"{prefix}.{name}"], theirs[f"{prefix}.{name}"]), name
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(ours["model.norm.weight"], theirs["model.norm.weight"])
    assert "lm_head.weight" not in ours  # tied: the logits use the embedding


def test_tensor_names() -> None:
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.attn_v.bias") == "model.layers.3.self_attn.v_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no counterpart"):
        hf_name("blk.0.ffn_gate_exps.weight")
