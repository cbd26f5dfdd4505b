"""Linear layers of the model: ``Linear`` runs kernels.linear (oneDNN on CPU), and ``MergedLinear``
stacks several checkpoint projections into one matmul (q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose product goes through kernels.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
