"""engine/tp/partition.py: what each rank holds of a model (heads, MLP width, vocabulary)."""

from __future__ import annotations

import pytest

from engine.model_config import ModelConfig
from engine.tp.partition import TPPartition, tp_problems

MODEL = ModelConfig(
    architecture="llama",
    vocab_size=10,
    hidden_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=96,
)


def test_rank_slices() -> None:
    ranks = [TPPartition(MODEL, r, 4) for r in range(4)]
    assert [(p.q_start, p.num_heads) for p in ranks] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(p.kv.start, p.kv.count) for p in ranks] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert {p.intermediate_size for p in ranks} == {24}
    # vocab 10 in slices of 3: the last rank holds one real row and two of padding
    assert [(p.vocab_start, p.vocab_rows) for p in ranks] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert TPPartition(MODEL).vocab_rows == 10


def test_replicated_kv_heads_follow_the_query_heads() -> None:
    """8 ranks, 4 KV heads: rank r's query head r reads KV head r // 2 (GQA group of 2)."""
    for r in range(8):
        p = TPPartition(MODEL, r, 8)
        assert p.kv.start == p.q_start // (MODEL.num_heads // MODEL.num_kv_heads)


def test_problems() -> None:
    assert tp_problems(MODEL, 3) == [
        "must divide the model's 8 query heads, got 3",
        "the model's 4 KV heads must divide by it, or it by them (KV heads then replicated), got 3",
    ]
    assert tp_problems(MODEL, 0) == ["must be >= 1, got 0"]
    with pytest.raises(ValueError, match="tensor_parallel_size: must divide"):
        TPPartition(MODEL, 0, 16)
