"""The K/V pages a CPU attention call reads, gathered from a paged cache into [B, Hkv, L, D].

In the head-outermost pool layout (kvcache/kv_buffer.py) a page's keys of one head are one
contiguous run, so the gather copies whole runs, one per (page, head), straight into [B, Hkv, L, D]
order. It writes into a workspace kept across layers and steps: a fresh multi-MB tensor per layer
goes back to the OS when freed under glibc's allocator and is page-faulted in again at the next
layer, which cost more than the attention itself (decode at batch 16 / 160 tokens with a 1 GiB
pool: 2.9 ms a layer against 0.46). Other cache layouts gather whole pages.

Decode's values in a float32 cache are not gathered at all: ``weighted_pages_sum`` sums them,
weighted by the attention's probabilities, from the pool itself; other dtypes are gathered.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

# A gather larger than this gets a tensor of its own rather than growing the workspace for good.
WORKSPACE_MAX_BYTES = 256 << 20


# Index lists kept per kind: two, so that a model alternating window and full-attention layers
# (two page lists a step) builds each list once a step, not once a layer.
_RECENT = 2


class _Workspace(threading.local):
    """Per thread: two growable buffers (one for K, one for V) the gathers write into, and the
    index lists built from the last page lists read (run ids of the gathers, slot rows of the
    in-place value sums): every layer of a step with the same window reads the same pages."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        # (page list, what else the ids depend on, the ids), newest last
        self.recent: dict[str, list[tuple[torch.Tensor, tuple[int, ...], tuple]]] = {}

    def take(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = numel * dtype.itemsize
        if nbytes > WORKSPACE_MAX_BYTES:
            return None
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    def _memo(self, kind: str, page_ids: torch.Tensor, key: tuple[int, ...], build) -> tuple:
        entries = self.recent.setdefault(kind, [])
        # (The page list is held here, so an identical object is the same list, not a reused id.)
        for held, held_key, value in entries:
            if held is page_ids and held_key == key:
                return value
        value = build()
        entries.append((page_ids, key, value))
        del entries[:-_RECENT]
        return value

    def runs_of(self, page_ids: torch.Tensor, rows: int, num_kv_heads: int) -> torch.Tensor:
        """Run ids [rows * Hkv * n]: row b's pages for head 0, then head 1, ... (page * Hkv + h)."""

        def build() -> tuple[torch.Tensor]:
            n = page_ids.numel() // max(rows, 1)
            heads = torch.arange(num_kv_heads, dtype=page_ids.dtype).view(1, -1, 1)
            return ((page_ids.view(rows, 1, n) * num_kv_heads + heads).reshape(-1),)

        return self._memo("runs", page_ids, (rows, num_kv_heads), build)[0]

    def bags_of(
        self, page_ids: torch.Tensor, rows: int, key: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot row ids, bag offsets) of ``weighted_pages_sum`` for this page list and cache
        geometry ``key`` = (Hkv, group, page size, then page / head / slot strides in rows)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            num_kv_heads, group, page_size, s_page, s_head, s_slot = key
            n = page_ids.numel() // max(rows, 1)
            ids = (
                page_ids.view(rows, 1, n, 1) * s_page
                + torch.arange(num_kv_heads).view(1, -1, 1, 1) * s_head
                + torch.arange(page_size).view(1, 1, 1, -1) * s_slot
            ).view(rows, num_kv_heads, 1, n * page_size)
            ids = ids.expand(-1, -1, group, -1).reshape(-1)
            length = n * page_size
            offsets = (
                torch.arange(0, ids.numel(), length) if length else torch.zeros(0, dtype=torch.long)
            )
            return ids, offsets

        return self._memo("bags", page_ids, (rows, *key), build)


WORKSPACE = _Workspace()


def head_runs(cache: torch.Tensor) -> torch.Tensor | None:
    """cache [N, page_size, Hkv, D] as rows [N * Hkv, page_size * D], row page * Hkv + h holding
    page's keys of head h, when each such run is contiguous and pages lie Hkv head strides apart
    (the head-outermost layout); None for other layouts."""
    num_pages, page_size, num_kv_heads, head_dim = cache.shape
    s_page, s_slot, s_head, s_dim = cache.stride()
    if s_dim != 1 or s_slot != head_dim or s_page != num_kv_heads * s_head:
        return None
    return cache.as_strided((num_pages * num_kv_heads, page_size * head_dim), (s_head, 1))


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, rows: int, slot: int) -> torch.Tensor:
    """cache [N, page_size, Hkv, D] at page_ids [rows * n] -> [rows, Hkv, n * page_size, D],
    written into workspace ``slot`` (0 for K, 1 for V) when it fits there."""
    _, page_size, num_kv_heads, head_dim = cache.shape
    runs = head_runs(cache)
    if runs is None:  # other layouts: whole pages, then heads outermost (one more copy: the
        # attention's products then see the operands the head-outermost gather gives them)
        gathered = cache.index_select(0, page_ids)  # [rows * n, page_size, Hkv, D]
        return gathered.view(rows, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
    run_ids = WORKSPACE.runs_of(page_ids, rows, num_kv_heads)
    out = WORKSPACE.take(slot, run_ids.numel() * page_size * head_dim, cache.dtype)
    if out is None:
        gathered = runs.index_select(0, run_ids)
    else:
        gathered = torch.index_select(runs, 0, run_ids, out=out.view(-1, page_size * head_dim))
    return gathered.view(rows, num_kv_heads, -1, head_dim)


def weighted_pages_sum(
    cache: torch.Tensor,  # [N, page_size, Hkv, D]
    page_ids: torch.Tensor,  # [rows * n] int64
    rows: int,
    weights: torch.Tensor,  # [rows, Hkv, group, n * page_size] float32
) -> torch.Tensor:  # [rows, Hkv, group, D]: sum over l of weights[..., l] * cache's key l
    """An attention's probabilities times its values, read from the pages where they lie.

    With every (page, slot, head) of the cache a row of D elements of one storage (strides in
    whole rows), this is ``embedding_bag``: a bag per query row, summing its keys' value rows
    weighted by their probabilities, with no gathered copy of the values. A decode step at batch
    32, 160 tokens, SmolLM2's heads, 2 threads: 0.34-0.37 ms a layer against 0.60-0.62 for the
    gather and the batched product. Other caches (another dtype, strides not in whole rows): the
    gather, in the weights' dtype, and a product."""
    _, page_size, num_kv_heads, head_dim = cache.shape
    group = weights.shape[2]
    strides, offset = cache.stride(), cache.storage_offset()
    if (
        cache.dtype != torch.float32
        or weights.dtype != torch.float32
        or strides[3] != 1
        or any(x % head_dim for x in strides[:3])
    ):
        return torch.matmul(weights, gather_pages(cache, page_ids, rows, 1).to(weights.dtype))
    s_page, s_slot, s_head = (x // head_dim for x in strides[:3])
    key = (num_kv_heads, group, page_size, s_page, s_head, s_slot)
    ids, offsets = WORKSPACE.bags_of(page_ids, rows, key)
    # The storage from this cache's first element on, one row per D elements.
    table_rows = (cache.untyped_storage().nbytes() // cache.itemsize - offset) // head_dim
    table = cache.as_strided((table_rows, head_dim), (head_dim, 1))
    out = F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=weights.reshape(-1))
    return out.view(rows, num_kv_heads, group, head_dim)
