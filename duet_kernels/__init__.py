"""Kernels: pure functions over tensors, each a Triton kernel with a plain-torch `*_ref` twin.

Dispatch, decided per call from the tensors and the environment:
- env ``DUET_KERNELS=ref``: always the reference (debugging);
- tensors on CUDA, or env ``DUET_KERNELS=triton``: the Triton kernel (the latter with
  ``TRITON_INTERPRET=1`` runs the Triton code on CPU tensors, as the tests do);
- otherwise the CPU implementation (attention_cpu.py, linear_cpu.py), which computes what the
  reference does in a few large torch ops.
The Triton modules are imported on first use, so CPU-only runs never import triton.

The package is not called ``kernels``: that name belongs to Hugging Face's kernel-hub package, which
transformers 5 installs and imports on start; a top-level ``kernels`` of ours shadowed it and broke
every transformers import in the same environment.
"""

from __future__ import annotations

import os

import torch

from duet_kernels.attention_cpu import (
    DecodePlan,
    PrefillPlan,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    plan_decode,
    plan_prefill,
    store_kv_cpu,
)
from duet_kernels.attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from duet_kernels.layer_ops_ref import add_rms_norm_ref, rotary_ref, silu_and_mul_ref
from duet_kernels.linear_cpu import linear_cpu, onednn_available, pack_weight
from duet_kernels.page_copy_ref import copy_pages_ref, gather_pages_ref, scatter_pages_ref

_ONEDNN = onednn_available()

__all__ = [
    "linear",
    "linear_on_cpu_path",
    "pack_linear_weight",
    "store_kv",
    "AttentionPlan",
    "plan_paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_pages",
    "scatter_pages",
    "copy_pages",
    "store_kv_cpu",
    "paged_decode_attention_cpu",
    "paged_prefill_attention_cpu",
    "store_kv_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "gather_pages_ref",
    "scatter_pages_ref",
    "copy_pages_ref",
    "add_rms_norm",
    "silu_and_mul",
    "rotary",
    "add_rms_norm_ref",
    "silu_and_mul_ref",
    "rotary_ref",
    "use_triton",
    "use_reference",
]


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call whose main tensor is `tensor` runs the Triton kernel (see module docstring)."""
    choice = os.environ.get("DUET_KERNELS", "")
    if choice == "ref":
        return False
    return tensor.is_cuda or choice == "triton"


def use_reference() -> bool:
    """Whether ``DUET_KERNELS=ref`` asks for the plain-torch references everywhere."""
    return os.environ.get("DUET_KERNELS", "") == "ref"


def linear_on_cpu_path(weight: torch.Tensor) -> bool:
    """Whether duet_kernels.linear runs products with ``weight`` on oneDNN (float32 on CPU)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and _ONEDNN
        and not use_reference()
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T + bias -> [..., out]: oneDNN for float32 on CPU (with
    ``packed``, weight in oneDNN's layout from pack_linear_weight, when given), else torch."""
    if x.dtype == torch.float32 and linear_on_cpu_path(weight):
        return linear_cpu(x, weight if packed is None else packed, bias)
    return torch.nn.functional.linear(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` packed for duet_kernels.linear on CPU, or None where linear does not use a packing."""
    return pack_weight(weight) if linear_on_cpu_path(weight) else None


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value [T, Hkv, D] to cache slots (page * page_size + offset); slots < 0 skipped."""
    if use_triton(k_cache):
        from duet_kernels.store_kv_triton import store_kv as impl
    elif use_reference():
        impl = store_kv_ref
    else:
        impl = store_kv_cpu
    impl(key, value, k_cache, v_cache, slot_mapping)


# What one step's paged attention over one page table and window shares across layers (CPU path).
AttentionPlan = DecodePlan | PrefillPlan


def plan_paged_attention(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    page_size: int,
    sliding_window: int | None = None,
) -> AttentionPlan | None:
    """The layer-independent part of a paged attention call (which pages each sequence reads,
    which keys each query sees), for every layer of a step that reads ``page_table`` with this
    window: a decode plan when ``cu_seqlens_q`` is None, else a prefill plan. None where the kernel
    that runs takes no plan (Triton, the references)."""
    if use_triton(page_table) or use_reference():
        return None
    if cu_seqlens_q is None:
        return plan_decode(page_table, seq_lens, page_size, sliding_window)
    return plan_prefill(page_table, cu_seqlens_q, seq_lens, page_size, sliding_window)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends over the first seq_lens[b] cached tokens of sequence b -> [B, Hq, D];
    with ``sliding_window`` W only over the last W of them; ``softcap`` caps scores by tanh.
    ``plan``: plan_paged_attention of the same table, lengths and window (the CPU path's)."""
    if use_triton(q):
        from duet_kernels.decode_attention_triton import paged_decode_attention as impl
    elif use_reference():
        impl = paged_decode_attention_ref
    else:
        assert plan is None or isinstance(plan, DecodePlan)
        return paged_decode_attention_cpu(
            q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window, softcap, plan
        )
    return impl(q, k_cache, v_cache, page_table, seq_lens, scale, sliding_window, softcap)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    plan: AttentionPlan | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Packed q [T, Hq, D], causal over the whole context: query i of sequence b sits at
    position seq_lens[b] - q_len_b + i (with ``sliding_window`` W it reads keys p - W + 1 .. p;
    ``softcap`` caps scores by tanh; ``plan`` as in paged_decode_attention; ``max_query_len``,
    the longest q_len_b where the caller knows it, spares the GPU kernel a device sync). Returns
    [T, Hq, D]."""
    if use_triton(q):
        from duet_kernels.prefill_attention_triton import paged_prefill_attention as triton_impl

        return triton_impl(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            sliding_window,
            softcap,
            max_query_len=max_query_len,
        )
    if use_reference():
        impl = paged_prefill_attention_ref
    else:
        assert plan is None or isinstance(plan, PrefillPlan)
        return paged_prefill_attention_cpu(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            sliding_window,
            softcap,
            plan,
        )
    return impl(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, sliding_window, softcap
    )


def gather_pages(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[page_ids[i]] for 2-D [N, E] / [n, E] page-row views. Returns out."""
    if use_triton(src):
        from duet_kernels.page_copy_triton import gather_pages as impl
    else:
        impl = gather_pages_ref
    return impl(src, page_ids, out)


def scatter_pages(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """dst[page_ids[i]] = src[i] for 2-D [n, E] / [N, E] page-row views. Returns dst."""
    if use_triton(dst):
        from duet_kernels.page_copy_triton import scatter_pages as impl
    else:
        impl = scatter_pages_ref
    return impl(src, dst, page_ids)


def copy_pages(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    first_row: int = 0,
) -> torch.Tensor:
    """dst[dst_ids[i]] = src[src_ids[i]] for 2-D [N, E] / [M, E] page-row views; a pair with an id
    outside [first_row, N) / [first_row, M) is skipped. Returns dst."""
    if use_triton(src):
        from duet_kernels.page_copy_triton import copy_pages as impl

        return impl(src, src_ids, dst, dst_ids, first_row=first_row)
    return copy_pages_ref(src, src_ids, dst, dst_ids, first_row)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of s, s) where s = x + residual (or x): x, residual [T, H]; see layer_ops_ref."""
    if use_triton(x):
        from duet_kernels.layer_ops_triton import add_rms_norm as impl
    else:
        impl = add_rms_norm_ref
    return impl(x, weight, eps, residual, offset)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a stacked gate/up projection [T, 2 * I] -> [T, I]."""
    if use_triton(gate_up):
        from duet_kernels.layer_ops_triton import silu_and_mul as impl
    else:
        impl = silu_and_mul_ref
    return impl(gate_up)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] at ``positions`` from cos/sin caches
    [max_positions, D], or (``positions`` None) from per-token tables [T, D]; returns new tensors."""
    if use_triton(q):
        from duet_kernels.layer_ops_triton import rotary as impl
    else:
        impl = rotary_ref
    return impl(q, k, positions, cos_cache, sin_cache)
