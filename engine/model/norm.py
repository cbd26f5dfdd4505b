"""RMSNorm, computed in float32 whatever the weight dtype (as transformers does)."""

from __future__ import annotations

import torch
from torch import nn

from duet_kernels import add_rms_norm


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (duet_kernels.add_rms_norm: one
    Triton kernel on a GPU instead of seven, the same bits as the torch ops)."""

    identity_weight = 1.0  # the weight that leaves the normalized input unscaled (dummy init)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return add_rms_norm(rows, self.weight, self.eps)[0].view(x.shape)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of s, s) with s = x + residual (x where residual is None), x [T, dim]: the
        residual add fused into the norm, as the pre-norm block needs it."""
        return add_rms_norm(x, self.weight, self.eps, residual)
