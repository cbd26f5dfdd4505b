"""Linear layers of the model: ``Linear`` runs duet_kernels.linear (oneDNN on CPU, with the weight packed
once into oneDNN's layout), ``MergedLinear`` stacks several checkpoint projections into one
matmul (q/k/v, gate/up), and ``RowParallelLinear`` sums its tensor-parallel ranks' partial products."""

from __future__ import annotations

import torch
from torch import nn

from duet_kernels import linear, pack_linear_weight
from engine.tp.context import TPContext


class PackedWeight:
    """A weight's copy in duet_kernels.linear's packed layout, made on first use and made again whenever
    the weight was written since (its in-place version counter changed) or replaced (another
    storage, shape or strides: a new Parameter, a slice of the old one)."""

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple[object, ...] | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight``; None where duet_kernels.linear uses none (GPU, other dtypes)."""
        # Inference tensors keep no version counter; their writes cannot be seen, only new storage.
        version = -1 if weight.is_inference() else weight._version
        key = (version, weight.data_ptr(), tuple(weight.shape), weight.stride())
        if key != self._key:
            self._packed, self._key = pack_linear_weight(weight), key
        return self._packed


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose product goes through duet_kernels.linear."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.packed_weight = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight.get(self.weight))


class RowParallelLinear(Linear):
    """A linear layer whose input columns are split over tensor-parallel ranks: each rank's
    product is a partial sum, added up over the ranks, then the (whole) bias once."""

    def __init__(self, *args: object, tp: TPContext | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(linear(x, self.weight, None, self.packed_weight.get(self.weight)))
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """``nn.Linear`` whose output rows are the concatenation of ``shard_sizes`` separate projections.

    Checkpoints store the projections separately (``q_proj``, ``k_proj``, ...); ``load_shard`` copies
    one of them into its rows, so the forward pass is one matmul instead of several.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, dtype=dtype)
        self.shard_sizes = shard_sizes

    def load_shard(self, shard: int, param_name: str, loaded: torch.Tensor) -> None:
        """Copy ``loaded`` (the checkpoint's weight [rows, in] or bias [rows]) into shard ``shard``."""
        param: torch.Tensor = getattr(self, param_name)
        start = sum(self.shard_sizes[:shard])
        rows = self.shard_sizes[shard]
        target = param.data[start : start + rows]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard} {param_name}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a forward output [T, sum(shard_sizes)] back into the per-projection parts."""
        return out.split(list(self.shard_sizes), dim=-1)
