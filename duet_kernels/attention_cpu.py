"""Paged attention on CPU tensors in a few large torch ops per layer (what runs on CPU).

The ``*_ref`` twins in attention_ref.py stay the readable oracle; these functions compute the same
thing faster, and tests/duet_kernels/test_attention_cpu.py compares the two on random paged inputs:
- each sequence's pages are gathered with one ``index_select`` per cache (advanced indexing of the
  strided layer view is several times slower); prefill attention runs through torch's
  ``scaled_dot_product_attention`` (its CPU flash kernel) over the gathered K/V, GQA included;
  with ``softcap`` (no SDPA option for it) through plain matmuls and a softmax instead;
- in the head-outermost pool layout (kvcache/kv_buffer.py) a page's keys of one head are one
  contiguous run, so the gather copies whole runs, one per (page, head), straight into
  [B, Hkv, L, D] order; it writes into a workspace kept across layers and steps (``_Workspace``):
  a fresh multi-MB tensor per layer goes back to the OS when freed under glibc's allocator and
  page-faults in again at the next layer, which cost more than the attention itself;
- with a sliding window, a sequence gathers only the pages its window covers, starting at its own
  first window page: a window group's page table holds the null page where pages left the window;
- decode: one batched product for the whole batch's scores, gathered keys only; the query heads
  that share a KV head are that head's query rows, so no K/V is repeated; the probabilities meet
  the values where they lie in a float32 pool (page_gather_cpu.weighted_pages_sum:
  ``embedding_bag``, no gathered copy; other dtypes gather them). Against SDPA over gathered K/V, same run, 30 layers of a step, 2 threads:
  1.28-1.55x at batch 16-64 (160-300 tokens); ``engine.LLM`` offline 1.04-1.18x (32 x 128
  tokens, 64 new);
- prefill: sequences of similar size share one padded call (padding bounded by ``PAD_BUDGET``), with
  a mask over absolute positions (prefix-cached contexts, sliding windows); one-token rows of a
  mixed batch go through the decode path;
- store_kv: ``index_put_`` on (page, offset), without a boolean filter unless a slot is padding.

What to gather and which keys each query sees depends only on the page table, the lengths and the
window, not on the layer: ``plan_decode`` / ``plan_prefill`` compute it once, and every layer of a
pool group with that window takes the same plan (engine/model/attention.py keeps them on the
ForwardBatch). Without a plan the attention functions make their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from duet_kernels.page_gather_cpu import gather_pages, weighted_pages_sum

# A prefill group's padded work (members x longest query x longest context) may reach this many
# times its members' own work (sum of query x context) before a new group starts.
PAD_BUDGET = 2.0
# Groups whose padded work is this small join regardless: another attention call costs more.
SMALL_WORK = 64 * 1024


@dataclass(frozen=True)
class DecodePlan:
    """What one decode attention call over B sequences reads: ``n`` pages per row, row-major."""

    page_ids: torch.Tensor  # [B * n] int64
    rows: int  # B
    # [B, 1, 1, n * page_size] bool, True = attend; None: every gathered key is attended
    mask: torch.Tensor | None
    # the mask as a float32 term added to the scores (0 or -inf), made once for every layer
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillGroupPlan:
    """One padded attention call over G prefill sequences of a packed batch."""

    page_ids: torch.Tensor  # [G * n] int64, n pages per member
    members: int  # G
    max_q: int  # the longest query of the group: each member's queries are padded to it
    # Packed rows of q <-> padded rows (member m's query j is padded row m * max_q + j); None when
    # the packed rows are already the padded ones, q[start : start + total] (one member, or
    # consecutive members of max_q queries each, as a burst of equal prompts is).
    src: torch.Tensor | None
    dst: torch.Tensor | None
    start: int
    total: int  # packed rows of the group
    # [G, 1, max_q, n * page_size] bool, True = attend; None: causal from the top-left corner
    mask: torch.Tensor | None


@dataclass(frozen=True)
class PrefillPlan:
    """A packed batch's prefill attention: its one-token rows as one decode call, the others in
    padded groups."""

    single_rows: torch.Tensor | None  # [S] int64, packed rows of the one-token sequences
    single: DecodePlan | None
    groups: list[PrefillGroupPlan]


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


def _page_window(
    page_table: torch.Tensor,  # [B, max_pages] int32
    first_key: np.ndarray,  # [B] the first key position each row reads
    lens: np.ndarray,  # [B] context lengths (keys at positions < len)
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row b's pages from the one holding ``first_key[b]`` to its last one, padded to the longest
    run with the null page -> (page ids [B * n] int64, key positions [B, n * page_size], n)."""
    first_page = first_key // page_size
    last_page = (lens - 1) // page_size
    n = int((last_page - first_page).max()) + 1
    if not first_page.any() and n <= page_table.shape[1]:  # every row from its first page
        page_ids = page_table[:, :n].long()
        pos = torch.arange(n * page_size).expand(len(lens), -1)
    else:
        cols = torch.from_numpy(first_page)[:, None] + torch.arange(n)[None, :]  # [B, n]
        inside = cols <= torch.from_numpy(last_page)[:, None]
        cols = torch.where(inside, cols, 0).clamp_(max=page_table.shape[1] - 1)
        page_ids = torch.where(inside, page_table.long().gather(1, cols), 0)
        pos = (cols[:, :, None] * page_size + torch.arange(page_size)).reshape(len(lens), -1)
        pos = torch.where(
            inside.repeat_interleave(page_size, dim=1), pos, torch.iinfo(pos.dtype).max
        )
    return page_ids.reshape(-1), pos, n


def plan_decode(
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_size: int,
    sliding_window: int | None = None,
) -> DecodePlan:
    """The pages and mask of one decode call: each row reads its last ``sliding_window`` keys (all
    of them without a window), from the page holding the first of them."""
    lens = seq_lens.numpy().astype(np.int64)
    B = len(lens)
    if B == 0:
        return DecodePlan(torch.empty(0, dtype=torch.long), 0, None)
    first_key = (
        np.zeros_like(lens) if sliding_window is None else np.maximum(lens - sliding_window, 0)
    )
    page_ids, pos, n = _page_window(page_table, first_key, lens, page_size)
    mask = None
    if sliding_window is not None or not (lens == n * page_size).all():
        lens_t = torch.from_numpy(lens)[:, None]
        keep = pos < lens_t
        if sliding_window is not None:
            keep &= pos >= lens_t - sliding_window
        mask = keep[:, None, None, :]
    return DecodePlan(page_ids, B, mask, None if mask is None else _bias(mask))


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = attend) as a float32 term added to the scores: 0 or -inf."""
    return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))


def prefill_groups(q_lens: np.ndarray, ctx_lens: np.ndarray) -> list[np.ndarray]:
    """Indices of the sequences with q_len >= 2, in groups that share one padded attention call.

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


def _plan_group(
    page_table: torch.Tensor,
    seqs: np.ndarray,  # the group's sequence indices
    q_starts: np.ndarray,  # [B] first packed row of each sequence
    q_lens: np.ndarray,  # [B]
    ctx_lens: np.ndarray,  # [B]
    page_size: int,
    sliding_window: int | None,
) -> PrefillGroupPlan:
    G = len(seqs)
    qs, ctxs, starts = q_lens[seqs], ctx_lens[seqs], q_starts[seqs]
    max_q, total = int(qs.max()), int(qs.sum())
    first_key = np.zeros_like(ctxs)
    if sliding_window is not None:  # the first query (at ctx - q) reads keys from there - W + 1
        first_key = np.maximum(ctxs - qs - sliding_window + 1, 0)
    page_ids, k_pos, _ = _page_window(
        page_table[torch.from_numpy(seqs)], first_key, ctxs, page_size
    )

    src = dst = None
    dense = bool((qs == max_q).all() and (starts == starts[0] + np.arange(G) * max_q).all())
    # Packed rows -> [G, max_q] padded rows: token j of member m goes to m * max_q + j.
    if not dense:
        within = np.arange(total) - np.repeat(np.cumsum(qs) - qs, qs)
        src = torch.from_numpy(np.repeat(starts, qs) + within)
        dst = torch.from_numpy(np.repeat(np.arange(G) * max_q, qs) + within)

    mask = None
    fresh = bool((qs == ctxs).all())  # no cached prefix: query j sits at position j
    if not (fresh and sliding_window is None):
        # Query j of a member sits at ctx - q_len + j (padding rows repeat its last query); key
        # positions of padding pages are past every query, so causality masks them.
        j = torch.arange(max_q)
        q_len_t, ctx_t = torch.from_numpy(qs)[:, None], torch.from_numpy(ctxs)[:, None]
        q_pos = ctx_t - q_len_t + torch.minimum(j[None, :], q_len_t - 1)  # [G, max_q]
        keep = k_pos[:, None, :] <= q_pos[:, :, None]  # [G, max_q, L]
        if sliding_window is not None:
            keep &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        mask = keep[:, None]
    # else top-left causal alignment is exact: padding rows only see real keys, then are dropped.
    return PrefillGroupPlan(page_ids, G, max_q, src, dst, int(starts[0]), total, mask)


def plan_prefill(
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    page_size: int,
    sliding_window: int | None = None,
) -> PrefillPlan:
    """The groups, pages and masks of one packed prefill call (see paged_prefill_attention_cpu)."""
    cu = cu_seqlens_q.numpy().astype(np.int64)
    q_starts, q_lens = cu[:-1], np.diff(cu)
    ctx_lens = seq_lens.numpy().astype(np.int64)
    single = np.flatnonzero(q_lens == 1)
    single_rows = single_plan = None
    if len(single):
        rows = torch.from_numpy(single)
        single_rows = torch.from_numpy(q_starts[single])
        single_plan = plan_decode(page_table[rows], seq_lens[rows], page_size, sliding_window)
    groups = [
        _plan_group(page_table, seqs, q_starts, q_lens, ctx_lens, page_size, sliding_window)
        for seqs in prefill_groups(q_lens, ctx_lens)
    ]
    return PrefillPlan(single_rows, single_plan, groups)


def _attend(
    q: torch.Tensor,  # [B, Hq or Hkv, Lq, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool [B, 1, Lq, L] (True = attend); None: causal from top-left
    scale: float,
    softcap: float | None,
    causal_if_unmasked: bool,
) -> torch.Tensor:  # [B, Hq or Hkv, Lq, D]
    out_dtype = q.dtype
    if q.dtype != torch.float32:  # the reference computes in float32 whatever the cache holds
        q, k, v = q.float(), k.float(), v.float()
    B, Hq, Lq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and causal_if_unmasked,
            scale=scale,
            enable_gqa=Hq != Hkv,
        )
        return out.to(out_dtype)
    # Soft-capped scores (no SDPA option): query heads of KV head h as a group axis over h's keys.
    group = Hq // Hkv
    q5 = q.reshape(B, Hkv, group, Lq, D)
    scores = torch.matmul(q5, k.transpose(-1, -2).unsqueeze(2)) * scale  # [B, Hkv, group, Lq, L]
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal_if_unmasked:
        mask = torch.ones((Lq, L), dtype=torch.bool).tril()[None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))  # [B, Hkv, group, Lq, D]
    return out.reshape(B, Hq, Lq, D).to(out_dtype)


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    plan: DecodePlan | None = None,  # plan_decode of the same table, lengths and window
) -> torch.Tensor:  # [B, Hq, D]
    B, Hq, D = q.shape
    if B == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = plan_decode(page_table, seq_lens, k_cache.shape[1], sliding_window)
    Hkv = k_cache.shape[2]
    k = gather_pages(k_cache, plan.page_ids, B, 0)  # [B, Hkv, L, D]
    # The query heads of KV head h are its query rows: [B, Hkv, group, D] against [B, Hkv, L, D].
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    if q.dtype != torch.float32:  # the reference computes in float32 whatever the cache holds
        qg, k = qg.float(), k.float()
    # A batched product and a softmax, not SDPA: with a few query rows per (sequence, KV head)
    # torch's CPU flash kernel took 1.5x as long (batch 32, 160 tokens, SmolLM2's heads, 2
    # threads: 0.38-0.49 against 0.60-0.71 ms a layer).
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, group, L]
    if softcap is None:
        scores.mul_(scale)
    else:
        scores = softcap * torch.tanh(scores * (scale / softcap))
    if plan.mask is not None:
        # (a plan made elsewhere may hold only the boolean mask)
        scores.add_(plan.bias if plan.bias is not None else _bias(plan.mask))
    probs = torch.softmax(scores, dim=-1)
    # (masked keys have probability 0: the padding pages they lie in add nothing)
    out = weighted_pages_sum(v_cache, plan.page_ids, B, probs)
    return out.reshape(B, Hq, D).to(q.dtype)


def _prefill_group(
    q: torch.Tensor,  # [T, Hq, D], packed
    out: torch.Tensor,  # [T, Hq, D], written at this group's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: PrefillGroupPlan,
    scale: float,
    softcap: float | None,
) -> None:
    _, Hq, D = q.shape
    G, max_q, start, total = group.members, group.max_q, group.start, group.total
    k = gather_pages(k_cache, group.page_ids, G, 0)  # [G, Hkv, L, D]
    v = gather_pages(v_cache, group.page_ids, G, 1)
    if group.src is None:
        q_pad = q[start : start + total]
    else:
        q_pad = q.new_zeros((G * max_q, Hq, D))
        q_pad.index_copy_(0, group.dst, q.index_select(0, group.src))
    q4 = q_pad.view(G, max_q, Hq, D).transpose(1, 2)  # [G, Hq, max_q, D]
    o = _attend(q4, k, v, group.mask, scale, softcap, causal_if_unmasked=True)
    o = o.transpose(1, 2).reshape(G * max_q, Hq, D)
    if group.src is None:
        out[start : start + total] = o[:total]
    else:
        out.index_copy_(0, group.src, o.index_select(0, group.dst))


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D], sequences packed one after another
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    plan: PrefillPlan | None = None,  # plan_prefill of the same batch and window
) -> torch.Tensor:  # [T, Hq, D]
    if plan is None:
        plan = plan_prefill(page_table, cu_seqlens_q, seq_lens, k_cache.shape[1], sliding_window)
    out = torch.empty_like(q)
    if plan.single is not None and plan.single_rows is not None:
        # One-token rows (decodes in a mixed batch) in one decode call.
        rows = plan.single_rows
        out[rows] = paged_decode_attention_cpu(
            q[rows],
            k_cache,
            v_cache,
            page_table,
            seq_lens,
            scale,
            softcap=softcap,
            plan=plan.single,
        )
    for group in plan.groups:
        _prefill_group(q, out, k_cache, v_cache, group, scale, softcap)
    return out
