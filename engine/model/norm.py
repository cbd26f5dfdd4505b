"""RMSNorm, computed in float32 whatever the weight dtype (as transformers does)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""

    identity_weight = 1.0  # the weight that leaves the normalized input unscaled (dummy init)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply: transformers rounds here too, and bf16 results then match.
        return self.weight * xf.to(input_dtype)
