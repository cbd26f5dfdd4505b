"""Which KV heads a tensor-parallel rank holds: its head shard of every page.

With ``tp`` ranks and ``H`` KV heads, either ``tp`` divides ``H`` (each rank holds ``H / tp``
consecutive heads, rank r from ``r * H / tp``) or ``H`` divides ``tp`` (each head is REPLICATED on
``tp / H`` consecutive ranks, rank r holding head ``r // (tp / H)``: the head its query heads
read, vLLM's and SGLang's rule). The first rank of a replicated head is its **primary**: the one a
peer reads the head from; the others hold identical copies nobody transfers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """KV heads ``[start, start + count)`` of ``total``, held by ``replicas`` ranks alike."""

    start: int
    count: int
    total: int
    replicas: int = 1
    primary: bool = True

    @property
    def stop(self) -> int:
        return self.start + self.count

    @property
    def replicated(self) -> bool:
        return self.replicas > 1

    def overlap(self, other: HeadShard) -> tuple[int, int]:
        """The heads both hold, as ``(start, count)`` (count 0: none)."""
        start = max(self.start, other.start)
        return start, max(0, min(self.stop, other.stop) - start)


def kv_heads_problem(num_kv_heads: int, tp_size: int) -> str | None:
    """Why ``tp_size`` ranks cannot split ``num_kv_heads`` heads, or None when they can."""
    if tp_size < 1:
        return f"must be >= 1, got {tp_size}"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (
            f"the model's {num_kv_heads} KV heads must divide by it, or it by them (KV heads then "
            f"replicated), got {tp_size}"
        )
    return None


def kv_head_shard(num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """The heads rank ``rank`` of ``tp_size`` holds (module docstring). Raises ValueError for a
    split ``kv_heads_problem`` refuses, or a rank outside ``[0, tp_size)``."""
    problem = kv_heads_problem(num_kv_heads, tp_size)
    if problem is not None:
        raise ValueError(f"tensor_parallel_size: {problem}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside [0, {tp_size})")
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return HeadShard(rank * per, per, num_kv_heads)
    replicas = tp_size // num_kv_heads
    return HeadShard(rank // replicas, 1, num_kv_heads, replicas, rank % replicas == 0)


def head_shards(num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Every rank's shard, in rank order."""
    return [kv_head_shard(num_kv_heads, tp_size, r) for r in range(tp_size)]
