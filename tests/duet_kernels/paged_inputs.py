"""Shared factories for the kernel tests: random paged KV in a page-major pool, and a dense oracle.

The pool has several layers and the page ids are shuffled, so a kernel that ignores strides, reads
the wrong layer, or assumes contiguous pages gets wrong numbers rather than lucky ones. Every page
(the null page and unused pages too) holds random data for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.kv_buffer import layer_view
from kvcache.spec import NULL_PAGE


@dataclass
class PagedKV:
    buffer: torch.Tensor  # [num_pages, Hkv, num_layers, 2, page_size, D] (kvcache/spec.py)
    k_cache: torch.Tensor  # layer_view(buffer, layer)[0]: [num_pages, page_size, Hkv, D], strided
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, NULL_PAGE padded
    seq_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # per sequence [L_b, Hkv, D], what the pages hold
    dense_v: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
    num_layers: int = 2,
    layer: int = 1,
    spare_pages: int = 3,
) -> PagedKV:
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    shape = (num_pages, num_kv_heads, num_layers, 2, page_size, head_dim)
    # Random numbers are drawn on the target device (fast for GPU-sized pools), seeded from `gen`.
    dev_gen = torch.Generator(device=device).manual_seed(
        int(torch.randint(2**62, (1,), generator=gen))
    )
    buffer = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    free_ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # never the null page
    page_table = torch.full(
        (len(seq_lens), max(pages_per_seq, default=0) + 1), NULL_PAGE, dtype=torch.int32
    )
    k_cache, v_cache = layer_view(buffer, layer)
    dense_k, dense_v = [], []
    for b, (n, n_pages) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        ids = [free_ids.pop() for _ in range(n_pages)]
        page_table[b, :n_pages] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn((n, num_kv_heads, head_dim), generator=dev_gen, device=device).to(dtype)
        v = torch.randn((n, num_kv_heads, head_dim), generator=dev_gen, device=device).to(dtype)
        for i, page in enumerate(
            ids
        ):  # token t lives in page ids[t // page_size], slot t % page_size
            lo, hi = i * page_size, min(n, (i + 1) * page_size)
            k_cache[page, : hi - lo] = k[lo:hi]
            v_cache[page, : hi - lo] = v[lo:hi]
        dense_k.append(k)
        dense_v.append(v)
    return PagedKV(
        buffer=buffer,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        dense_k=dense_k,
        dense_v=dense_v,
    )


def sdpa_oracle(
    q: torch.Tensor,  # [q_len, Hq, D], the last q_len positions of the context
    k: torch.Tensor,  # [L, Hkv, D] contiguous
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, Hq, D] float64
    """Dense causal attention through torch SDPA in float64, independent of the paged code."""
    q_len, num_q_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    qh = q.double().permute(1, 0, 2)  # [Hq, q_len, D]
    kh = k.double().repeat_interleave(group, dim=1).permute(1, 0, 2)  # [Hq, L, D]
    vh = v.double().repeat_interleave(group, dim=1).permute(1, 0, 2)
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    k_pos = torch.arange(ctx_len)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.to(q.device), scale=scale)
    return out.permute(1, 0, 2)


def eager_softcap_oracle(
    q: torch.Tensor,  # [q_len, Hq, D], the last q_len positions of the context
    k: torch.Tensor,  # [L, Hkv, D] contiguous
    v: torch.Tensor,
    scale: float,
    softcap: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, Hq, D] float64
    """Soft-capped dense causal attention in float64 through transformers' own eager attention
    (Gemma 2's, the one that applies ``softcap``)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q_len, num_q_heads, head_dim = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    k_pos = torch.arange(ctx_len)[None, :]
    seen = k_pos <= q_pos
    if sliding_window is not None:
        seen &= k_pos > q_pos - sliding_window
    mask = torch.zeros(seen.shape, dtype=torch.float64).masked_fill(~seen, float("-inf"))
    module = SimpleNamespace(
        num_key_value_groups=num_q_heads // num_kv_heads, training=False, head_dim=head_dim
    )
    out, _ = eager_attention_forward(
        module,  # type: ignore[arg-type]
        q.double().permute(1, 0, 2)[None],  # [1, Hq, q_len, D]
        k.double().permute(1, 0, 2)[None],  # [1, Hkv, L, D]
        v.double().permute(1, 0, 2)[None],
        mask[None, None],
        scaling=scale,
        softcap=softcap,
    )
    return out[0]  # [q_len, Hq, D]


def pack_queries(
    q_lens: list[int],
    num_q_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed queries [T, Hq, D] as a strided view (every other head row of a wider
    tensor), with cu_seqlens_q [B + 1] int32."""
    total = sum(q_lens)
    wide = torch.randn((total, 2 * num_q_heads, head_dim), generator=gen).to(dtype).to(device)
    cu = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return wide[:, ::2], cu
