"""store_kv in Triton: write each new token's key and value into its cache slot.

Program (t, head block) copies token t's [heads, D] rows of key and value to slot
``slot_mapping[t]`` (page = slot // page_size, offset = slot % page_size) of the strided cache
views; negative slots are padding and write nothing. Converts to the cache dtype on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet_kernels.checks import check_cache_pair, next_power_of_2


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcp,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcp,
    stride_vct,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (heads < num_kv_heads)[:, None]
    t64 = t.to(tl.int64)

    k = tl.load(
        key_ptr + t64 * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=ok,
    )
    k_dst = k_cache_ptr + page * stride_kcp + offset * stride_kct
    tl.store(
        k_dst + heads[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=ok,
    )
    v = tl.load(
        value_ptr + t64 * stride_vt + heads[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=ok,
    )
    v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vct
    tl.store(
        v_dst + heads[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=ok,
    )


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; slot = page * page_size + offset, < 0 skipped
) -> None:
    page_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [T, Hkv, D] = {expected}, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # At most ~4K elements per program: one token of Llama-3-8B (8 x 128) is a single program.
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // head_dim))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=block_h,
        num_warps=4,
    )
