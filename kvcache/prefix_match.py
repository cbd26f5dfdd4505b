"""Prefix lookup: the cached pages a new request can start from, across full and window groups and
both tiers (device, host), and the check that a match is still good when it is taken."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_hash import hash_block
from kvcache.host_pool import HostPool
from kvcache.page_pool import PagePool
from kvcache.sliding_window import hybrid_hit_pages, pages_before_hit
from kvcache.spec import NULL_PAGE


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages covering the first ``num_tokens`` tokens of a prompt.

    A match is a plain value: it holds no refs. Hand it to ``KVCacheManager.allocate_slots`` on the
    request's first call (before any other allocation happens, or an eviction may make it stale, which
    ``allocate_slots`` detects and refuses with ValueError).

    Attributes:
        num_tokens: tokens covered (a multiple of page_size, always < num_query_tokens).
        page_ids: group name -> the cached device page ids, in order (``num_tokens // page_size``
            each). A sliding-window group lists only the pages of the window before the hit; the
            positions before them hold the null page. So does a position found in the host tier.
        block_hashes: the chained hash of each matched page, in order.
        num_query_tokens: length of the token list that was looked up (for hit/miss stats).
        host_pages: group name -> {position: host page} of the pages found only in the host tier
            (kvcache/host_tier.py): ``allocate_slots`` loads them back into new device pages.
    """

    num_tokens: int = 0
    page_ids: dict[str, list[int]] = field(default_factory=dict)
    block_hashes: list[int] = field(default_factory=list)
    num_query_tokens: int = 0
    host_pages: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return len(self.block_hashes)

    @property
    def num_host_tokens(self) -> int:
        """Tokens of the hit whose page some group loads back from the host tier."""
        return self.host_tokens_taken(None)

    def host_tokens_taken(self, page_ids: dict[str, list[int]] | None) -> int:
        """Tokens of the hit that a request's allocation loaded back from the host tier, given the
        request's pages after it (``page_ids``; None: as the engine's admission takes them, all).
        Fewer than ``num_host_tokens`` when the allocation starts past the hit (the decode
        worker's, which counts the whole prompt computed): a window group's host pages before its
        window stay where they are."""
        positions = {
            i
            for g, pages in self.host_pages.items()
            for i in pages
            if page_ids is None or (i < len(page_ids.get(g, [])) and page_ids[g][i] != NULL_PAGE)
        }
        return len(positions) * (self.num_tokens // self.num_pages if self.num_pages else 0)


def find_cached_prefix(
    token_ids: Sequence[int],
    page_size: int,
    pools: dict[str, PagePool],
    windows: dict[str, int | None],
    host: dict[str, HostPool] | None = None,
) -> PrefixMatch:
    """The longest prefix, in whole pages and at most ``len(token_ids) - 1`` tokens, that every
    group can serve (vLLM's hybrid allocator).

    A hit at t tokens needs, in each full-attention group, the pages of all of [0, t), and in each
    window group of window W, the pages holding t - W + 1 .. t - 1 (what the query at t reads). Full
    groups are scanned left to right (a hit at t implies one at every shorter t); window groups right
    to left from there, each shortening t until all agree, since a window hit at t says nothing about
    shorter ones. A page counts as cached in a group when the device pool or, given ``host``, the
    host tier beneath it has it; the device copy is preferred. Pure lookup: takes no refs and
    changes nothing.
    """
    host = host or {}

    def cached(g: str, block_hash: int) -> bool:
        if pools[g].lookup(block_hash) is not None:
            return True
        return g in host and host[g].lookup(block_hash) is not None

    n = len(token_ids)
    full = [g for g in pools if windows[g] is None]
    hashes: list[int] = []
    parent: int | None = None
    for i in range(max(0, (n - 1) // page_size)):
        block_hash = hash_block(parent, token_ids[i * page_size : (i + 1) * page_size])
        if not all(cached(g, block_hash) for g in full):
            break
        hashes.append(block_hash)
        parent = block_hash
    needed = {g: pages_before_hit(w, page_size) for g, w in windows.items() if w is not None}
    k = hybrid_hit_pages(len(hashes), needed, lambda g, i: cached(g, hashes[i]))
    page_ids: dict[str, list[int]] = {}
    host_pages: dict[str, dict[int, int]] = {}
    for g, pool in pools.items():
        first = max(0, k - needed[g]) if g in needed else 0
        ids = [NULL_PAGE] * first
        for i in range(first, k):
            page = pool.lookup(hashes[i])
            if page is None:
                host_pages.setdefault(g, {})[i] = host[g].lookup(hashes[i])  # type: ignore[assignment]
            ids.append(NULL_PAGE if page is None else page)
        page_ids[g] = ids
    return PrefixMatch(k * page_size, page_ids, hashes[:k], n, host_pages)


def check_prefix(
    prefix: PrefixMatch,
    num_total_tokens: int,
    page_size: int,
    pools: dict[str, PagePool],
    windows: dict[str, int | None],
    host: dict[str, HostPool] | None,
) -> None:
    """Raise ValueError unless ``prefix`` can be taken now for a request of ``num_total_tokens``
    tokens: whole pages, no gap, and every page (device or host) still holding its block (an
    allocation since ``find_cached_prefix`` may have evicted or dropped one: a stale match)."""
    if prefix.num_tokens != prefix.num_pages * page_size:
        raise ValueError(
            f"prefix covers {prefix.num_tokens} tokens but has {prefix.num_pages} pages"
        )
    if prefix.num_tokens > num_total_tokens:
        raise ValueError(
            f"prefix of {prefix.num_tokens} tokens exceeds num_total_tokens={num_total_tokens}"
        )
    if not prefix.num_pages:
        return
    for g, pool in pools.items():
        ids = prefix.page_ids.get(g, [])
        hosted = prefix.host_pages.get(g, {})
        if len(ids) != prefix.num_pages:
            raise ValueError(
                f"prefix has {len(ids)} pages for group {g!r}, expected {prefix.num_pages}"
            )
        if hosted and (host is None or g not in host):
            raise ValueError(f"prefix lists host-tier pages of group {g!r}, there is no tier")
        first = next((i for i, p in enumerate(ids) if p != NULL_PAGE or i in hosted), len(ids))
        gap = any(p == NULL_PAGE and i not in hosted for i, p in enumerate(ids) if i >= first)
        if gap or (first and windows[g] is None):
            raise ValueError(f"prefix pages of group {g!r} have a gap: {ids}")
        for i in range(first, len(ids)):
            h = prefix.block_hashes[i]
            if i in hosted:
                found, page, where = host[g].lookup(h), hosted[i], "host page"  # type: ignore[index]
            else:
                found, page, where = pool.lookup(h), ids[i], "page"
            if found != page:
                raise ValueError(
                    f"stale PrefixMatch: {where} {page} of group {g!r} no longer holds block "
                    f"{h:#x}; call match_prefix right before allocate_slots"
                )
