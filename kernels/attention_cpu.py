"""Paged attention on CPU tensors in a few large torch ops per layer (what runs on CPU).

The ``*_ref`` twins in attention_ref.py stay the readable oracle; these functions compute the same
thing faster, and tests/kernels/test_attention_cpu.py compares the two on random paged inputs:
- each sequence's context pages are gathered with one ``index_select`` per cache (advanced indexing
  of the strided layer view is several times slower), and attention runs through torch's
  ``scaled_dot_product_attention`` (its CPU flash kernel) over the gathered K/V, GQA included;
- decode: one SDPA call for the whole batch; the query heads that share a KV head are that head's
  query rows, so no K/V is repeated;
- prefill: sequences of similar size share one padded SDPA call (padding bounded by
  ``PAD_BUDGET``), with a causal mask over absolute positions (prefix-cached contexts and sliding
  windows); one-token rows of a mixed batch go through the decode path;
- store_kv: ``index_put_`` on (page, offset), without a boolean filter unless a slot is padding.

Nothing here loops over the requests of a batch in Python except the grouping of prefill sequences,
which runs once per call on a few small integer arrays.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# A prefill group's padded work (members x longest query x longest context) may reach this many
# times its members' own work (sum of query x context) before a new group starts.
PAD_BUDGET = 2.0
# Groups whose padded work is this small join regardless: another SDPA call costs more.
SMALL_WORK = 64 * 1024


def store_kv_cpu(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], possibly strided
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative slots are skipped (padding)
) -> None:
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    page_size = k_cache.shape[1]
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - pages * page_size
    k_cache.index_put_((pages, offsets), key.to(k_cache.dtype))
    v_cache.index_put_((pages, offsets), value.to(v_cache.dtype))


def _gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """cache [N, page_size, Hkv, D] at page_ids [rows * n] -> [rows, Hkv, n * page_size, D] (a
    transposed view of a contiguous copy)."""
    _, page_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, page_ids)  # [rows * n, page_size, Hkv, D], contiguous
    return gathered.view(rows, -1, num_kv_heads, head_dim).transpose(1, 2)


def _sdpa(
    q: torch.Tensor,  # [B, Hq or Hkv, Lq, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool [B, 1, Lq, L] (True = attend) or None
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    out_dtype = q.dtype
    if q.dtype != torch.float32:  # the reference computes in float32 whatever the cache holds
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.to(out_dtype)


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    B, Hq, D = q.shape
    if B == 0:
        return torch.empty_like(q)
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.long()
    max_len = int(lens.max())
    last_page = (max_len + page_size - 1) // page_size
    first_page = 0
    if sliding_window is not None:  # pages before every sequence's window are never read
        first_page = max(0, int(lens.min()) - sliding_window) // page_size
    page_ids = page_table[:, first_page:last_page].reshape(-1).long()
    k = _gather_pages(k_cache, page_ids, B)  # [B, Hkv, L, D]
    v = _gather_pages(v_cache, page_ids, B)
    pos = torch.arange(first_page * page_size, last_page * page_size)
    mask = pos[None, :] < lens[:, None]  # [B, L]
    if sliding_window is not None:
        mask &= pos[None, :] >= lens[:, None] - sliding_window
    # The query heads of KV head h are its query rows: [B, Hkv, group, D] against [B, Hkv, L, D].
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    out = _sdpa(qg, k, v, mask[:, None, None, :], scale)  # [B, Hkv, group, D]
    return out.reshape(B, Hq, D)


def prefill_groups(q_lens: np.ndarray, ctx_lens: np.ndarray) -> list[np.ndarray]:
    """Indices of the sequences with q_len >= 2, in groups that share one padded SDPA call.

    Sequences are taken longest context first; one joins the current group while the group's
    padded work stays within PAD_BUDGET times its own (or below SMALL_WORK).
    """
    order = [int(i) for i in np.argsort(-ctx_lens, kind="stable") if q_lens[i] >= 2]
    groups: list[list[int]] = []
    work = max_q = max_ctx = 0
    for i in order:
        q, ctx = int(q_lens[i]), int(ctx_lens[i])
        if groups:
            members = len(groups[-1]) + 1
            padded = members * max(max_q, q) * max(max_ctx, ctx)
            if padded <= SMALL_WORK or padded <= PAD_BUDGET * (work + q * ctx):
                groups[-1].append(i)
                work, max_q, max_ctx = work + q * ctx, max(max_q, q), max(max_ctx, ctx)
                continue
        groups.append([i])
        work, max_q, max_ctx = q * ctx, q, ctx
    return [np.asarray(g, dtype=np.int64) for g in groups]


def _prefill_group(
    q: torch.Tensor,  # [T, Hq, D], packed
    out: torch.Tensor,  # [T, Hq, D], written at this group's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqs: np.ndarray,  # the group's sequence indices
    q_starts: np.ndarray,  # [B] first packed row of each sequence
    q_lens: np.ndarray,  # [B]
    ctx_lens: np.ndarray,  # [B]
    scale: float,
    sliding_window: int | None,
) -> None:
    _, Hq, D = q.shape
    page_size = k_cache.shape[1]
    G = len(seqs)
    qs, ctxs, starts = q_lens[seqs], ctx_lens[seqs], q_starts[seqs]
    max_q = int(qs.max())
    first_page = 0
    if sliding_window is not None:  # the earliest key any query of the group reads
        first_page = max(0, int((ctxs - qs).min()) - sliding_window + 1) // page_size
    last_page = (int(ctxs.max()) + page_size - 1) // page_size
    rows = torch.from_numpy(seqs)
    page_ids = page_table[rows, first_page:last_page].reshape(-1).long()
    k = _gather_pages(k_cache, page_ids, G)  # [G, Hkv, L, D]
    v = _gather_pages(v_cache, page_ids, G)

    # Packed rows -> [G, max_q] padded rows: token j of member m goes to m * max_q + j.
    total = int(qs.sum())
    within = np.arange(total) - np.repeat(np.cumsum(qs) - qs, qs)
    src = torch.from_numpy(np.repeat(starts, qs) + within)
    dst = torch.from_numpy(np.repeat(np.arange(G) * max_q, qs) + within)
    if G == 1:
        q_pad = q[int(starts[0]) : int(starts[0]) + total]
    else:
        q_pad = q.new_zeros((G * max_q, Hq, D))
        q_pad[dst] = q[src]
    q4 = q_pad.view(G, max_q, Hq, D).transpose(1, 2)  # [G, Hq, max_q, D]

    fresh = bool((qs == ctxs).all())  # no cached prefix: query j sits at position j
    if fresh and sliding_window is None and first_page == 0:
        # Top-left causal alignment is exact here; padding rows only see real keys, then are dropped.
        o = _sdpa(q4, k, v, None, scale, is_causal=True)
    else:
        # Query j of a member sits at ctx - q_len + j (padding rows repeat its last query).
        j = torch.arange(max_q)
        q_len_t, ctx_t = torch.from_numpy(qs)[:, None], torch.from_numpy(ctxs)[:, None]
        q_pos = ctx_t - q_len_t + torch.minimum(j[None, :], q_len_t - 1)  # [G, max_q]
        k_pos = torch.arange(first_page * page_size, last_page * page_size)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, max_q, L]
        if sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        o = _sdpa(q4, k, v, mask[:, None], scale)
    o = o.transpose(1, 2).reshape(G * max_q, Hq, D)
    if G == 1:
        out[int(starts[0]) : int(starts[0]) + total] = o[:total]
    else:
        out[src] = o[dst]


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D], sequences packed one after another
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.numpy().astype(np.int64)
    q_starts, q_lens = cu[:-1], np.diff(cu)
    ctx_lens = seq_lens.numpy().astype(np.int64)
    single = np.flatnonzero(q_lens == 1)
    if len(single):  # one-token rows (decodes in a mixed batch) in one decode call
        rows = torch.from_numpy(single)
        q_rows = torch.from_numpy(q_starts[single])
        out[q_rows] = paged_decode_attention_cpu(
            q[q_rows],
            k_cache,
            v_cache,
            page_table[rows],
            seq_lens[rows],
            scale,
            sliding_window,
        )
    for seqs in prefill_groups(q_lens, ctx_lens):
        _prefill_group(
            q,
            out,
            k_cache,
            v_cache,
            page_table,
            seqs,
            q_starts,
            q_lens,
            ctx_lens,
            scale,
            sliding_window,
        )
    return out
