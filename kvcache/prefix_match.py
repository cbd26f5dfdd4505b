"""The result of a prefix lookup: cached pages a new request can start from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages covering the first ``num_tokens`` tokens of a prompt.

    A match is a plain value: it holds no refs. Hand it to ``KVCacheManager.allocate_slots`` on the
    request's first call (before any other allocation happens, or an eviction may make it stale, which
    ``allocate_slots`` detects and refuses with ValueError).

    Attributes:
        num_tokens: tokens covered (a multiple of page_size, always < num_query_tokens).
        page_ids: group name -> the cached page ids, in order (``num_tokens // page_size`` each).
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
