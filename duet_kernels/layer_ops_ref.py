"""Plain-torch reference twins of a decoder layer's fused elementwise ops (also their CPU path).

Each one rounds where transformers' own modules round (to the activation dtype after every torch
op), so the Triton versions, which fuse the ops into one kernel, reproduce the same bits:

- ``add_rms_norm_ref``: optional residual add, then RMSNorm in float32, cast back, times weight;
- ``silu_and_mul_ref``: ``silu(gate) * up`` of a stacked [T, 2 * I] gate/up projection;
- ``rotary_ref``: rotate-half RoPE of q and k from a cos/sin cache indexed by position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual): ``s = x + residual`` (or x), ``normed = (offset + weight) * rms(s)``.

    ``offset`` is 1 for Gemma's (1 + w) norms, which scale in float32 before casting (as
    transformers' Gemma3RMSNorm does); Llama's multiply the cast value by the weight.
    """
    s = x if residual is None else x + residual
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (sf * (offset + weight.float())).to(s.dtype), s
    return weight * sf.to(s.dtype), s


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, D] of every position, computed exactly as the per-step tables
    (float32 products, then cast), so indexing them gives the same bits."""
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor | None,  # [T] int; None: the tables are per token
    cos_cache: torch.Tensor,  # [max_positions, D], or [T, D] when positions is None
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions is not None:
        cos_cache, sin_cache = cos_cache[positions], sin_cache[positions]
    cos, sin = cos_cache[:, None, :], sin_cache[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)
