"""A decoder layer's elementwise ops fused in Triton: one kernel each instead of five to ten.

On a GPU the decode step of a small batch is bound by weight reads and by the number of kernels:
the eager RMSNorm is seven kernels, rotary twelve, SiLU-and-mul two. These kernels keep every
rounding of the references (duet_kernels/layer_ops_ref.py): a value is cast to the activation dtype
wherever the torch op sequence would have produced an activation-dtype tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet_kernels.checks import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's rounding
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if GEMMA:
        y = normed * (offset + w.to(tl.float32))
    else:
        y = normed.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As duet_kernels.layer_ops_ref.add_rms_norm_ref; rows must be contiguous in the last dim."""
    rows, cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm needs rows contiguous in the last dimension")
    out_dtype = weight.dtype if not offset else x.dtype
    if not offset:  # Llama: weight (dtype) * cast value -> promoted dtype, as torch does
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out,
            cols,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0),
            eps,
            offset,
            HAS_RESIDUAL=residual is not None,
            GEMMA=bool(offset),
            BLOCK=next_power_of_2(cols),
            num_warps=8 if cols >= 4096 else 4,
        )
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the activation dtype
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(g.dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_POS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (heads < num_heads)[:, None]
    d = tl.arange(0, HALF)
    if HAS_POS:
        pos = tl.load(pos_ptr + t).to(tl.int64)
    else:  # per-token tables: row t is token t's
        pos = t
    # cos/sin hold the same value at d and d + HALF (the table is cat(freqs, freqs))
    c1 = tl.load(cos_ptr + pos * stride_c + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_c + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_c + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_c + HALF + d).to(tl.float32)[None, :]
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(base + d[None, :], mask=ok, other=0.0)
    x2 = tl.load(base + HALF + d[None, :], mask=ok, other=0.0)
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as the eager ops round it
    o1 = (x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)
    o2 = (x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    tl.store(obase + d[None, :], o1.to(dt), mask=ok)
    tl.store(obase + HALF + d[None, :], o2.to(dt), mask=ok)


def _rotate(
    x: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("rotary needs head_dim contiguous")
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        block_h = min(next_power_of_2(heads), 16)
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x,
            out,
            positions if positions is not None else cos,
            cos,
            sin,
            heads,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            HALF=dim // 2,
            BLOCK_H=block_h,
            HAS_POS=positions is not None,
            num_warps=4,
        )
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As duet_kernels.layer_ops_ref.rotary_ref (head_dim a power of two)."""
    return _rotate(q, positions, cos_cache, sin_cache), _rotate(k, positions, cos_cache, sin_cache)
