"""Prefix lookup: the cached pages a new request can start from, across full and window groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_hash import hash_block
from kvcache.page_pool import PagePool
from kvcache.sliding_window import longest_window_hit, pages_before_hit
from kvcache.spec import NULL_PAGE


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages covering the first ``num_tokens`` tokens of a prompt.

    A match is a plain value: it holds no refs. Hand it to ``KVCacheManager.allocate_slots`` on the
    request's first call (before any other allocation happens, or an eviction may make it stale, which
    ``allocate_slots`` detects and refuses with ValueError).

    Attributes:
        num_tokens: tokens covered (a multiple of page_size, always < num_query_tokens).
        page_ids: group name -> the cached page ids, in order (``num_tokens // page_size`` each). A
            sliding-window group lists only the pages of the window before the hit; the positions
            before them hold the null page.
        block_hashes: the chained hash of each matched page, in order.
        num_query_tokens: length of the token list that was looked up (for hit/miss stats).
    """

    num_tokens: int = 0
    page_ids: dict[str, list[int]] = field(default_factory=dict)
    block_hashes: list[int] = field(default_factory=list)
    num_query_tokens: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.block_hashes)


def find_cached_prefix(
    token_ids: Sequence[int],
    page_size: int,
    pools: dict[str, PagePool],
    windows: dict[str, int | None],
) -> PrefixMatch:
    """The longest prefix, in whole pages and at most ``len(token_ids) - 1`` tokens, that every
    group can serve (vLLM's hybrid allocator).

    A hit at t tokens needs, in each full-attention group, the pages of all of [0, t), and in each
    window group of window W, the pages holding t - W + 1 .. t - 1 (what the query at t reads). Full
    groups are scanned left to right (a hit at t implies one at every shorter t); window groups right
    to left from there, each shortening t until all agree, since a window hit at t says nothing about
    shorter ones. Pure lookup: takes no refs and changes nothing.
    """
    n = len(token_ids)
    full = [g for g in pools if windows[g] is None]
    hashes: list[int] = []
    parent: int | None = None
    for i in range(max(0, (n - 1) // page_size)):
        block_hash = hash_block(parent, token_ids[i * page_size : (i + 1) * page_size])
        if any(pools[g].lookup(block_hash) is None for g in full):
            break
        hashes.append(block_hash)
        parent = block_hash
    needed = {g: pages_before_hit(w, page_size) for g, w in windows.items() if w is not None}
    k = len(hashes)
    while True:
        before = k
        for g, need in needed.items():
            pool = pools[g]
            k = longest_window_hit(lambda i, pool=pool: pool.lookup(hashes[i]) is not None, k, need)
        if k == before:
            break
    page_ids: dict[str, list[int]] = {}
    for g, pool in pools.items():
        first = max(0, k - needed[g]) if g in needed else 0
        page_ids[g] = [NULL_PAGE] * first + [pool.lookup(h) for h in hashes[first:k]]  # type: ignore[misc]
    return PrefixMatch(k * page_size, page_ids, hashes[:k], n)
