"""One pool group's host-tier page accounting: the hash -> host page index, LRU order, and pins.

States of a host page (pages ``0 .. num_pages-1``; no null page, nothing indexes host pages):

- **free**: holds nothing; first in line for a store.
- **cached**: holds a stored device page's KV under its block hash; findable by ``lookup``; dropped
  in LRU order when a store needs room.
- **pinned**: cached, and read by one or more load-backs in flight (pin count > 0): never dropped
  or overwritten until every load-back reading it landed.

Every unpinned page is in the drop queue: free pages at the head (taken first), cached pages after
them from least to most recently used. A cached page dropped before any load-back read it is a
**host drop** (the store was wasted); a store that finds every page pinned is a **skipped store**.
This class moves no bytes: kvcache/host_tier.py copies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.free_queue import FreeQueue
from kvcache.stats import HostTierStats


@dataclass(frozen=True)
class Stored:
    """Where a store put a page, and the hash it dropped to make room (None: a free page)."""

    page: int
    dropped_hash: int | None


class HostPool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._index: dict[int, int] = {}  # block hash -> host page
        self._pins = [0] * num_pages
        self._reused = [False] * num_pages  # loaded back at least once since it was stored
        self._queue = FreeQueue(num_pages)
        for page in range(num_pages):
            self._queue.append(page)
        self.num_cached = 0
        self.offloaded = 0
        self.loaded_back = 0
        self.drops = 0
        self.skipped_stores = 0

    # ---- counts (pages) ----
    @property
    def num_pinned(self) -> int:
        return self.num_pages - len(self._queue)

    @property
    def num_free(self) -> int:
        return self.num_pages - self.num_cached

    def stats(self, page_size: int) -> HostTierStats:
        return HostTierStats(
            total=self.num_pages,
            used=self.num_cached,
            free=self.num_free,
            pinned=self.num_pinned,
            offloaded=self.offloaded,
            loaded_back=self.loaded_back,
            hit_tokens=self.loaded_back * page_size,
            drops=self.drops,
            skipped_stores=self.skipped_stores,
        )

    def page_hash(self, page: int) -> int | None:
        return self._page_hash[page]

    def pin_count(self, page: int) -> int:
        return self._pins[page]

    def drop_order(self) -> list[int]:
        """Unpinned pages in the order stores take them (free first, then least recently used)."""
        return list(self._queue)

    def cached_hashes(self) -> list[int]:
        return list(self._index)

    # ---- the index ----
    def lookup(self, block_hash: int) -> int | None:
        return self._index.get(block_hash)

    def touch(self, page: int) -> None:
        """Mark a cached unpinned page most recently used (its device copy was evicted again)."""
        if self._page_hash[page] is None:
            raise RuntimeError(f"host page {page}: touch needs a cached page")
        if self._pins[page] == 0:
            self._queue.remove(page)
            self._queue.append(page)

    # ---- stores and load-backs ----
    def store(self, block_hash: int) -> Stored | None:
        """Take a page for ``block_hash`` (not cached yet): a free page, else the least recently
        used cached one (dropped: its hash leaves the index). None when every page is pinned (a
        skipped store, counted). The caller copies the device page into the returned page."""
        if block_hash in self._index:
            raise RuntimeError(f"block {block_hash:#x} is already in the host tier")
        if len(self._queue) == 0:
            self.skipped_stores += 1
            return None
        page = self._queue.popleft()
        dropped = self._page_hash[page]
        if dropped is not None:
            del self._index[dropped]
            if not self._reused[page]:
                self.drops += 1
        else:
            self.num_cached += 1
        self._page_hash[page] = block_hash
        self._index[block_hash] = page
        self._reused[page] = False
        self._queue.append(page)
        self.offloaded += 1
        return Stored(page, dropped)

    def pin(self, page: int) -> None:
        """A load-back will read ``page``: it cannot be dropped until ``unpin``."""
        if self._page_hash[page] is None:
            raise RuntimeError(f"host page {page}: only a cached page can be loaded back")
        if self._pins[page] == 0:
            self._queue.remove(page)
        self._pins[page] += 1
        self._reused[page] = True
        self.loaded_back += 1

    def unpin(self, page: int) -> None:
        """A load-back of ``page`` landed: it becomes the most recently used page."""
        if self._pins[page] <= 0:
            raise RuntimeError(f"host page {page} unpinned with pin count {self._pins[page]}")
        self._pins[page] -= 1
        if self._pins[page] == 0:
            self._queue.append(page)

    def drop_cached(self) -> list[int]:
        """Forget every cached page (a prefix cache reset): each becomes free, and no lookup finds
        it again. Only while no load-back is in flight (a pinned page is being read). Returns the
        hashes dropped."""
        if self.num_pinned:
            raise RuntimeError(f"drop_cached with {self.num_pinned} host pages pinned")
        dropped = list(self._index)
        for page in self._index.values():
            self._page_hash[page] = None
            self._reused[page] = False
            self._queue.remove(page)  # (free pages come before cached ones in the drop queue)
            self._queue.appendleft(page)
        self._index.clear()
        self.num_cached = 0
        return dropped

    # ---- invariants ----
    def check_integrity(self, pins: dict[int, int], name: str = "host pool") -> None:
        """Verify the accounting against ``pins`` (host page -> load-backs in flight reading it)."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"{name}: {msg}")

        try:
            self._queue.check_integrity()
        except RuntimeError as e:
            fail(str(e))
        for page in range(self.num_pages):
            if self._pins[page] != pins.get(page, 0):
                fail(f"page {page} pinned {self._pins[page]} times, {pins.get(page, 0)} loads")
            if (self._pins[page] == 0) != (page in self._queue):
                fail(f"page {page}: pin count {self._pins[page]} vs drop queue membership")
            if self._pins[page] and self._page_hash[page] is None:
                fail(f"page {page} is pinned but holds nothing")
        for block_hash, page in self._index.items():
            if self._page_hash[page] != block_hash:
                fail(f"index maps {block_hash:#x} to page {page}, which holds another block")
        cached = sum(h is not None for h in self._page_hash)
        if cached != len(self._index) or cached != self.num_cached:
            fail(f"{cached} pages hold a block, index {len(self._index)}, count {self.num_cached}")
        order = list(self._queue)
        seen_cached = False
        for page in order:  # free pages all come before cached ones
            if self._page_hash[page] is not None:
                seen_cached = True
            elif seen_cached:
                fail(f"free page {page} queued after a cached page: {order}")
