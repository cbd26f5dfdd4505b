"""Paged decode attention in Triton: one query token per sequence, split-K (flash-decoding).

Decode is bound by reading K/V, so the work is cut to keep every SM streaming:
program (kv_head, split, b) reads the split's share of sequence b's tokens for one kv head and
serves all query heads of that GQA group with the same K/V tile (the group is padded to 16 rows,
the smallest tl.dot tile). Each split writes an un-normalized partial (running max m, sum l,
accumulator) and a second small kernel merges the splits. Kv heads of one (b, split) get adjacent
program ids, so programs running together read neighbouring bytes of the same pages.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from duet_kernels.checks import (
    check_cache_pair,
    check_query,
    dot_precision,
    next_power_of_2,
    softcap_args,
    window_arg,
)
from duet_kernels.paged_addressing import soft_cap_tanh, token_page_and_slot

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel; the defaults were chosen by scripts/bench_kernels.py."""

    block_n: int = 64  # tokens per loop step
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None  # None: enough splits for `programs_per_sm` programs per SM
    programs_per_sm: int = 4


def default_decode_config(device: torch.device) -> DecodeConfig:
    if device.type != "cuda":  # interpreter: small tiles, so tiny tests cross tile boundaries
        return DecodeConfig(block_n=16, num_stages=1)
    return DecodeConfig()


@triton.jit
def _load_kv_tile(
    k_head,
    v_head,
    page_row,
    tile,
    end,
    stride_kp,
    stride_kt,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vd,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """K and V [BLOCK_N, D] of tokens tile .. tile + BLOCK_N (those >= end masked to 0)."""
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile + tl.arange(0, BLOCK_N)
    ok = tok < end
    page, slot = token_page_and_slot(page_row, tok, ok, PAGE_SIZE)
    k = tl.load(
        k_head + (page * stride_kp + slot * stride_kt)[:, None] + offs_d[None, :] * stride_kd,
        mask=ok[:, None],
        other=0.0,
    )
    v = tl.load(
        v_head + (page * stride_vp + slot * stride_vt)[:, None] + offs_d[None, :] * stride_vd,
        mask=ok[:, None],
        other=0.0,
    )
    return k, v, ok


@triton.jit
def _online_softmax_step(
    q,
    k,
    v,
    ok,
    m_i,
    l_i,
    acc,
    qk_scale,
    cap_scale,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Folds one K/V tile into the running max m_i, sum l_i and un-normalized acc (log2 domain)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    if SOFTCAP:
        s = cap_scale * soft_cap_tanh(s)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qb,
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
    stride_ob,
    stride_oh,
    stride_od,
    num_q_heads,
    num_splits,
    qk_scale,
    cap_scale,
    window,
    SOFTCAP: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < GROUP
    q_heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr
        + b.to(tl.int64) * stride_qb
        + q_heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=head_ok[:, None],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)
    page_row = page_table_ptr + b.to(tl.int64) * stride_pt
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

    # Finite initial max: a split or tile with every token masked keeps exp2(-inf - m) = 0, no NaN.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        k, v, ok = _load_kv_tile(
            k_head,
            v_head,
            page_row,
            tile,
            end,
            stride_kp,
            stride_kt,
            stride_kd,
            stride_vp,
            stride_vt,
            stride_vd,
            HEAD_DIM,
            PAGE_SIZE,
            BLOCK_N,
        )
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, ok, m_i, l_i, acc, qk_scale, cap_scale, SOFTCAP, DOT_PRECISION
        )

    if WRITE_OUTPUT:  # a single split: normalize here and skip the merge kernel
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = (
            out_ptr
            + b.to(tl.int64) * stride_ob
            + q_heads[:, None] * stride_oh
            + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = (b.to(tl.int64) * num_q_heads + q_heads) * num_splits + split  # [BLOCK_H]
        tl.store(m_ptr + row, m_i, mask=head_ok)
        tl.store(l_ptr + row, l_i, mask=head_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    num_q_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < num_splits
    row = (b.to(tl.int64) * num_q_heads + head) * num_splits + offs_s
    m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
    l_sum = tl.load(l_ptr + row, mask=ok, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # padding splits: exp2(-inf) = 0
    den = tl.sum(l_sum * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter on CPU: a few splits, so the merge path is exercised too


def choose_num_splits(
    batch: int, num_kv_heads: int, device: torch.device, config: DecodeConfig
) -> int:
    """Splits per sequence, from the batch shape alone: not from the page table's width, which a
    CUDA graph fixes at max_pages_per_seq while an eager step trims it, so that both run the same
    splits and sum in the same order (graph replays give the eager tokens). A split past a
    sequence's end exits at once."""
    if config.num_splits is not None:
        return max(1, config.num_splits)
    target = config.programs_per_sm * _num_sms(device)
    splits = math.ceil(target / max(1, batch * num_kv_heads))
    return max(1, min(splits, 64))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], any strides
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:  # [B, Hq, D], q's dtype
    """Attention of each sequence's one new query over its first seq_lens[b] cached tokens."""
    qk_scale, cap_scale = softcap_args(scale, softcap, LOG2E)
    config = config or default_decode_config(q.device)
    page_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    group = check_query(q, num_kv_heads, head_dim)
    batch, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = choose_num_splits(batch, num_kv_heads, q.device, config)
    if splits > 1:
        m = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty(
            (batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:
        m = l_sum = acc = out  # unused by the single-split variant
    _decode_split_kernel[(num_kv_heads, splits, batch)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        out,
        m,
        l_sum,
        acc,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        page_table.stride(0),
        *out.stride(),
        num_q_heads,
        splits,
        qk_scale,
        cap_scale,
        window_arg(sliding_window),
        SOFTCAP=softcap is not None,
        GROUP=group,
        BLOCK_H=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=config.block_n,
        WRITE_OUTPUT=splits == 1,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _decode_merge_kernel[(num_q_heads, batch)](
            m,
            l_sum,
            acc,
            out,
            *out.stride(),
            num_q_heads,
            splits,
            HEAD_DIM=head_dim,
            SPLITS_P2=next_power_of_2(splits),
            num_warps=4,
        )
    return out
