"""How a model splits across ``tp`` tensor-parallel ranks: query heads, KV heads, the MLP width and
the vocabulary (pure arithmetic; engine/tp/shard_weights.py cuts the checkpoint by it, and the
attention and MLP layers size their shards by it).

- Query heads: ``num_heads / tp`` consecutive heads per rank (tp must divide them).
- KV heads: kvcache/head_shard.py (sharded when tp divides them, else replicated).
- MLP: ``intermediate_size / tp`` consecutive columns of gate and up (rows of down) per rank.
- Vocabulary: ``ceil(vocab / tp)`` consecutive rows per rank, the last rank's padded with zero rows,
  so every rank's logits slice has one size. Not used yet: the embedding and the LM head are
  replicated on every rank, and only rank 0 computes logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from kvcache.head_shard import HeadShard, kv_head_shard, kv_heads_problem


def tp_problems(config: ModelConfig, tp_size: int) -> list[str]:
    """Why ``tp_size`` ranks cannot split ``config`` (one message per problem, each fit to follow
    ``tensor_parallel_size: ``), or [] when they can."""
    if tp_size < 1:
        return [f"must be >= 1, got {tp_size}"]
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"must divide the model's {config.num_heads} query heads, got {tp_size}")
    kv = kv_heads_problem(config.num_kv_heads, tp_size)
    if kv is not None:
        problems.append(kv)
    if config.intermediate_size % tp_size:
        problems.append(
            f"must divide the model's MLP width (intermediate_size {config.intermediate_size}), "
            f"got {tp_size}"
        )
    return problems


@dataclass(frozen=True)
class TPPartition:
    """What rank ``rank`` of ``size`` holds of a model (module docstring)."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        problems = tp_problems(self.config, self.size)
        if problems:
            raise ValueError("tensor_parallel_size: " + "; ".join(problems))
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside [0, {self.size})")

    @property
    def num_heads(self) -> int:
        """Query heads of this rank."""
        return self.config.num_heads // self.size

    @property
    def q_start(self) -> int:
        """The first query head of this rank."""
        return self.rank * self.num_heads

    @property
    def kv(self) -> HeadShard:
        return kv_head_shard(self.config.num_kv_heads, self.size, self.rank)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of the vocabulary this rank holds for real (the rest of its slice is padding)."""
        return max(0, min(self.config.vocab_size - self.vocab_start, self.vocab_per_rank))
