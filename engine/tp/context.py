"""TPContext: what a model layer needs to know of tensor parallelism: the sizes of its shard
(engine/tp/partition.py) and the group its row-parallel outputs are summed over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.tp.comm import TPGroup
from engine.tp.partition import TPPartition


@dataclass(frozen=True)
class TPContext:
    partition: TPPartition
    group: TPGroup | None = None
    """None only for shape-only builds (meta tensors); a forward pass with tp > 1 needs it."""

    @property
    def size(self) -> int:
        return self.partition.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.partition.size == 1:
            return tensor
        if self.group is None:
            raise RuntimeError("a tensor-parallel forward pass needs the ranks' group")
        return self.group.all_reduce(tensor)
