"""Paged prefill attention in Triton: variable-length causal attention over prefix-cached context.

Sequences are packed along the token axis (cu_seqlens_q). Query i of sequence b sits at position
``seq_lens[b] - q_len_b + i`` and sees cached tokens up to and including that position (the new
tokens' K/V are stored in the cache before this runs). Program (q_head, m_block, b) keeps one
BLOCK_M x D query tile and streams K/V tiles with an online (flash-attention) softmax.

Masks cost ALU time in a compute-bound loop, so each query tile walks three ranges: tiles cut by
the sliding window's lower edge (masked), tiles every row sees whole (unmasked), and tiles on the
causal diagonal (masked). Heads of one kv head get adjacent program ids, so their K/V tiles are
read from HBM once and served from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from duet_kernels.checks import (
    check_cache_pair,
    check_query,
    dot_precision,
    softcap_args,
    window_arg,
)
from duet_kernels.paged_addressing import soft_cap_tanh, token_page_and_slot

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_prefill_config(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> PrefillConfig:
    if device.type != "cuda":  # interpreter: small tiles, so tiny tests cross tile boundaries
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # fp32 products run on the FMA units and need many registers
        return PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_head,
    v_head,
    page_row,
    lo,
    hi,
    ctx_len,
    stride_kp,
    stride_kt,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vd,
    qk_scale,
    cap_scale,
    window,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in range(lo, hi, BLOCK_N):
        tok = tile + offs_n
        ok = tok < ctx_len
        page, slot = token_page_and_slot(page_row, tok, ok, PAGE_SIZE)
        k = tl.load(
            k_head + (page * stride_kp + slot * stride_kt)[:, None] + offs_d[None, :] * stride_kd,
            mask=ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = cap_scale * soft_cap_tanh(s)
        if MASKED:
            seen = (tok[None, :] <= q_pos[:, None]) & (tok[None, :] > q_pos[:, None] - window)
            s = tl.where(seen & ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + (page * stride_vp + slot * stride_vt)[:, None] + offs_d[None, :] * stride_vd,
            mask=ok[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_pt,
    stride_ot,
    stride_oh,
    stride_od,
    qk_scale,
    cap_scale,
    window,
    SOFTCAP: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest-running tiles start first
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + b + 1).to(tl.int32) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m_block * BLOCK_M + offs_m
    row_ok = rows < q_len
    q_pos = ctx_len - q_len + rows
    tok_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)

    # Key ranges for this tile of rows (positions pos_min..pos_max), see the module docstring.
    pos_min = ctx_len - q_len + m_block * BLOCK_M
    pos_max = tl.minimum(pos_min + BLOCK_M - 1, ctx_len - 1)
    hi = pos_max + 1
    lo_tile = tl.maximum(pos_min - window + 1, 0) // BLOCK_N * BLOCK_N
    full_hi = (pos_min + 1) // BLOCK_N * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(pos_max - window + 1, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(tl.minimum(full_lo, full_hi), lo_tile)
    full_hi = tl.maximum(full_hi, full_lo)

    kv_head = head // GROUP
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    page_row = page_table_ptr + b.to(tl.int64) * stride_pt
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_head,
        v_head,
        page_row,
        lo_tile,
        full_lo,
        ctx_len,
        stride_kp,
        stride_kt,
        stride_kd,
        stride_vp,
        stride_vt,
        stride_vd,
        qk_scale,
        cap_scale,
        window,
        SOFTCAP,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        True,
        DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_head,
        v_head,
        page_row,
        full_lo,
        full_hi,
        ctx_len,
        stride_kp,
        stride_kt,
        stride_kd,
        stride_vp,
        stride_vt,
        stride_vd,
        qk_scale,
        cap_scale,
        window,
        SOFTCAP,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        False,
        DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_head,
        v_head,
        page_row,
        full_hi,
        hi,
        ctx_len,
        stride_kp,
        stride_kt,
        stride_kd,
        stride_vp,
        stride_vt,
        stride_vd,
        qk_scale,
        cap_scale,
        window,
        SOFTCAP,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_N,
        True,
        DOT_PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr + tok_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], sequences packed one after another
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], any strides
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    config: PrefillConfig | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """Causal attention of the packed new tokens over each sequence's whole cached context.

    The grid is sized by the longest query run: ``max_query_len`` when the caller knows it (the
    engine does, from the host copy of the batch), else read from cu_seqlens_q, which costs a
    device sync per call, i.e. per layer, and leaves the GPU idle while the next layer's kernels
    are launched.
    """
    page_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    group = check_query(q, num_kv_heads, head_dim)
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must have B + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    out = torch.empty_like(q)
    if batch == 0 or q.shape[0] == 0:
        return out
    config = config or default_prefill_config(q.device, k_cache.dtype, head_dim)
    max_q_len = max_query_len
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    num_m_blocks = triton.cdiv(max_q_len, config.block_m)
    if num_m_blocks == 0:
        return out
    _prefill_kernel[(q.shape[1], num_m_blocks, batch)](
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        seq_lens,
        out,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        page_table.stride(0),
        *out.stride(),
        *softcap_args(scale, softcap, LOG2E),
        window_arg(sliding_window),
        SOFTCAP=softcap is not None,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
