"""Argument checks shared by the Triton kernel wrappers: fail early, saying what was expected.

The Triton kernels index caches through strides, so any strided view is accepted; what they do need
is a power-of-two head_dim (tile width), matching dtypes, and the GQA divisibility.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
MIN_HEAD_DIM = 16  # tl.dot needs every tile side >= 16
MAX_HEAD_DIM = 256

# Stands for "no sliding window" inside the kernels: larger than any context, so the window's lower
# bound max(0, pos - window) is always 0 and no constexpr variant is needed.
NO_WINDOW = 1 << 30


def check_head_dim(head_dim: int) -> None:
    if head_dim < MIN_HEAD_DIM or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] for the Triton "
            f"kernels (e.g. 64 or 128), got {head_dim}"
        )


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Checks [num_pages, page_size, Hkv, D] views; returns (page_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_pages, page_size, num_kv_heads, head_dim] views of the "
            f"same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"k_cache/v_cache dtype must be one of float32, bfloat16, float16 and equal, got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    check_head_dim(head_dim)
    return page_size, num_kv_heads, head_dim


def check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Checks q [*, Hq, D] against the cache; returns the GQA group size Hq // Hkv."""
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [tokens, num_q_heads, {head_dim}], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return q.shape[1] // num_kv_heads


def window_arg(sliding_window: int | None) -> int:
    if sliding_window is None:
        return NO_WINDOW
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return min(sliding_window, NO_WINDOW)


def softcap_args(scale: float, softcap: float | None, log2e: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) of the kernels, whose softmax runs in the log2 domain: scores are
    ``dot * qk_scale``, then with soft-capping ``cap_scale * tanh(that)``, so that both ways the
    result is the capped score times log2(e)."""
    if softcap is None:
        return scale * log2e, 1.0
    if not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return scale / softcap, softcap * log2e


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get exact fp32 products (tf32 would cost ~1e-3 relative error); 16-bit ones
    run on the tensor cores either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
