"""engine/tp/shard_weights.py and the loaders: each rank holds exactly its part of every tensor,
whichever loader made it (safetensors read as slices, dummy weights drawn whole then cut)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loaders import load_model
from engine.loaders.load import read_model_config
from engine.tp.context import TPContext
from engine.tp.partition import TPPartition
from engine.tp.shard_weights import hf_shard
from tests.engine.tp.conftest import TP_HF_CONFIGS


def test_column_row_and_replicated_tensors() -> None:
    cfg = read_model_config("default", "dummy", dict(TP_HF_CONFIGS["llama"]))
    part = TPPartition(cfg, rank=1, size=2)  # query heads 4..7, KV heads 2..3, MLP 48..95
    d = cfg.head_dim
    assert hf_shard("model.layers.0.self_attn.q_proj.weight", (64, 64), part) == (0, 4 * d, 8 * d)
    assert hf_shard("model.layers.0.self_attn.k_proj.weight", (32, 64), part) == (0, 2 * d, 4 * d)
    assert hf_shard("model.layers.0.self_attn.v_proj.bias", (32,), part) == (0, 2 * d, 4 * d)
    assert hf_shard("model.layers.0.self_attn.o_proj.weight", (64, 64), part) == (1, 4 * d, 8 * d)
    assert hf_shard("model.layers.0.self_attn.o_proj.bias", (64,), part) is None  # added once
    assert hf_shard("model.layers.1.mlp.up_proj.weight", (96, 64), part) == (0, 48, 96)
    assert hf_shard("model.layers.1.mlp.down_proj.weight", (64, 96), part) == (1, 48, 96)
    for whole in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert hf_shard(whole, (320, 64), part) is None
    assert hf_shard("model.layers.0.self_attn.q_proj.weight", (64, 64), TPPartition(cfg)) is None


def test_replicated_kv_heads_give_each_rank_its_one_head() -> None:
    cfg = read_model_config("default", "dummy", dict(TP_HF_CONFIGS["qwen3"]))  # 2 KV heads
    d = cfg.head_dim
    cuts = [
        hf_shard("model.layers.0.self_attn.k_proj.weight", (2 * d, 64), TPPartition(cfg, r, 4))
        for r in range(4)
    ]
    assert cuts == [(0, 0, d), (0, 0, d), (0, d, 2 * d), (0, d, 2 * d)]


@pytest.mark.parametrize(("source", "size"), [("hf", 2), ("dummy", 2), ("gguf", 3)])
def test_every_rank_holds_its_slice_of_the_one_model(
    source: str, size: int, tp_checkpoints: dict[str, Path]
) -> None:
    """hf and dummy: the tiny Llama at tp 2; gguf: the embedded SmolLM2 (9 query heads, 3 KV
    heads) at tp 3, its last rank."""
    path = "default" if source == "gguf" else str(tp_checkpoints["llama"])
    fmt = {"hf": "hf", "dummy": "dummy", "gguf": "gguf"}[source]
    whole = dict(load_model(path, fmt, seed=3).model.named_parameters())
    cfg = read_model_config(path, fmt)
    for rank in range(size) if size == 2 else [size - 1]:
        part = TPPartition(cfg, rank, size)
        tp = TPContext(part)  # shapes and loading only: no group needed
        shard = dict(load_model(path, fmt, seed=3, tp=tp).model.named_parameters())
        full = whole["model.layers.1.self_attn.qkv_proj.weight"]
        q, k, v = full.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        d, nq, kv = cfg.head_dim, part.num_heads, part.kv
        expected = torch.cat(
            [
                q[part.q_start * d : (part.q_start + nq) * d],
                k[kv.start * d : kv.stop * d],
                v[kv.start * d : kv.stop * d],
            ]
        )
        assert torch.equal(shard["model.layers.1.self_attn.qkv_proj.weight"], expected)
        width = part.intermediate_size
        down = whole["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(
            shard["model.layers.0.mlp.down_proj.weight"],
            down[:, rank * width : (rank + 1) * width],
        )
        o = whole["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(
            shard["model.layers.0.self_attn.o_proj.weight"],
            o[:, part.q_start * d : (part.q_start + nq) * d],
        )
        assert torch.equal(shard["model.embed_tokens.weight"], whole["model.embed_tokens.weight"])
