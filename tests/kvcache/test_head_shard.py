"""kvcache/head_shard.py: which KV heads each tensor-parallel rank holds, sharded or replicated."""

from __future__ import annotations

import pytest

from kvcache.head_shard import HeadShard, head_shards, kv_head_shard, kv_heads_problem


def test_sharded_heads_are_consecutive_runs() -> None:
    assert head_shards(4, 2) == [HeadShard(0, 2, 4), HeadShard(2, 2, 4)]
    assert [(s.start, s.count) for s in head_shards(8, 4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert head_shards(4, 1) == [HeadShard(0, 4, 4)]


def test_replicated_heads_have_one_primary_each() -> None:
    """8 ranks over 4 KV heads: ranks 2h and 2h+1 hold head h; 2h is the one a peer reads."""
    shards = head_shards(4, 8)
    assert [(s.start, s.count, s.replicas, s.primary) for s in shards] == [
        (0, 1, 2, True), (0, 1, 2, False), (1, 1, 2, True), (1, 1, 2, False),
        (2, 1, 2, True), (2, 1, 2, False), (3, 1, 2, True), (3, 1, 2, False),
    ]  # fmt: skip
    assert all(s.replicated for s in shards)
    assert [s.start for s in head_shards(1, 4)] == [0, 0, 0, 0]


def test_overlap() -> None:
    assert HeadShard(0, 4, 8).overlap(HeadShard(2, 4, 8)) == (2, 2)
    assert HeadShard(0, 2, 8).overlap(HeadShard(2, 2, 8))[1] == 0


def test_refused_splits() -> None:
    assert kv_heads_problem(4, 3) is not None and kv_heads_problem(4, 0) == "must be >= 1, got 0"
    assert kv_heads_problem(4, 8) is None and kv_heads_problem(6, 3) is None
    with pytest.raises(ValueError, match="KV heads must divide by it"):
        kv_head_shard(4, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        kv_head_shard(4, 2, 2)
