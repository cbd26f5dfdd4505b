"""Plain-torch reference twins of the paged attention kernels (the oracle of the Triton and CPU paths).

Cache views: ``k_cache``/``v_cache`` are [num_pages, page_size, num_kv_heads, head_dim], possibly
strided (one layer of a page-major pool, see kvcache/spec.py). GQA: query head h reads kv head
h // (num_q_heads // num_kv_heads). ``softcap``: scores s = scale * q.k become softcap * tanh(s /
softcap) before the mask and softmax (Gemma 2's attention soft-capping, as transformers applies it).
"""

from __future__ import annotations

import torch


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative slots are skipped (padding)
) -> None:
    page_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = key[valid].to(k_cache.dtype)
    v_cache[pages, offsets] = value[valid].to(v_cache.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    B, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max()) if B else 0
    n_pages = (max_len + page_size - 1) // page_size
    pt = page_table[:, :n_pages].long()
    # [B, n_pages, page_size, Hkv, D] -> [B, L, Hkv, D], vectorized over the batch
    k = k_cache[pt].reshape(B, n_pages * page_size, Hkv, D)[:, :max_len].float()
    v = v_cache[pt].reshape(B, n_pages * page_size, Hkv, D)[:, :max_len].float()
    group = Hq // Hkv
    qf = q.float().view(B, Hkv, group, D)
    scores = _soft_cap(torch.einsum("bhgd,blhd->bhgl", qf, k) * scale, softcap)  # [B, Hkv, G, L]
    pos = torch.arange(max_len, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    mask = pos[None, :] < lens
    if sliding_window is not None:
        mask &= pos[None, :] >= lens - sliding_window
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(B, Hq, D).to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D], sequences packed one after another
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, ctx_len in enumerate(lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_pages = (ctx_len + page_size - 1) // page_size
        pages = page_table[b, :n_pages].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:ctx_len].float()  # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, Hkv, D)[:ctx_len].float()
        qb = q[q_start:q_end].float().view(q_len, Hkv, group, D)
        scores = _soft_cap(torch.einsum("qhgd,lhd->hgql", qb, k) * scale, softcap)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgql,lhd->qhgd", probs, v)
        out[q_start:q_end] = o.reshape(q_len, Hq, D).to(q.dtype)
    return out
