"""One pool group's page accounting: ref counts, the free queue and the hash -> page prefix index.

States of a usable page (page 0, the null page, is in none of them and never changes):

- **used**: ref count > 0 (held by one or more requests; a cached page can be shared).
- **evictable**: ref count 0 and registered in the index: its KV may still be reused by a prefix hit,
  until an allocation takes it (LRU: from the free queue's head) and drops its hash.
- **free**: ref count 0 and not registered.

Every page with ref count 0 is in the free queue. Evictable pages join it at the tail (kept as long as
possible); plain free pages join at the head (handed out before any cached page is evicted).
This class knows nothing about requests: the manager says which pages to take and release.

Interval peaks (since construction or the last ``reset_peaks``): the most pages used at once, the
most evictable at once, and the fewest plain free (neither used nor cached) at once. The pools of
one manager also share a ``PagesHeld``: the pages used in all of them together and that total's
peak, which the sum of their own peaks overstates (a window group peaks in a long prefill, the full
group at the end of decode).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from kvcache.free_queue import FreeQueue
from kvcache.spec import NULL_PAGE
from kvcache.stats import HostTierStats, PoolGroupStats


class PagesHeld:
    """Pages used in every pool sharing this, and the most used at once since the last
    ``reset_peak``: counted where pages are taken and given back, so the peak is the total's own."""

    __slots__ = ("used", "peak")

    def __init__(self) -> None:
        self.used = 0
        self.peak = 0

    def take(self, num_pages: int) -> None:
        self.used += num_pages
        if self.used > self.peak:
            self.peak = self.used

    def reset_peak(self) -> None:
        self.peak = self.used


class PagePool:
    """Pages ``1 .. num_pages-1`` of one pool group (``num_pages`` counts the null page).
    ``held``: the count this pool's used pages add to (shared by a manager's pools); its own when
    None."""

    def __init__(self, num_pages: int, held: PagesHeld | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._page_hash: list[int | None] = [None] * num_pages
        self._index: dict[int, int] = {}  # block hash -> page id
        self._free_queue = FreeQueue(num_pages)
        for page_id in range(1, num_pages):
            self._free_queue.append(page_id)
        self._num_evictable = 0
        self.num_evictions = 0  # cached pages whose hash was dropped to make room
        self.peak_used = 0
        self.peak_evictable = 0
        self.free_low_water = self.num_usable
        self.held = held if held is not None else PagesHeld()
        # Called with (page id, its block hash) when an allocation evicts a cached page, before
        # the page is handed out: its KV is still intact (the host tier copies it then).
        self.on_evict: Callable[[int, int], None] | None = None

    # ---- counts (pages) ----
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: plain free plus evictable."""
        return len(self._free_queue)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_plain_free(self) -> int:
        """Pages neither held nor cached: what an allocation takes before evicting anything."""
        return self.num_free - self._num_evictable

    def stats(self, window: int | None, host: HostTierStats | None) -> PoolGroupStats:
        return PoolGroupStats(
            total=self.num_usable,
            free=self.num_free,
            used=self.num_used,
            evictable=self._num_evictable,
            peak_used=self.peak_used,
            evictions=self.num_evictions,
            peak_evictable=self.peak_evictable,
            free_low_water=self.free_low_water,
            sliding_window=window,
            host=host,
        )

    def reset_peaks(self) -> None:
        """Start a new stats interval: every peak becomes the current count (``held``'s too)."""
        self.peak_used = self.num_used
        self.peak_evictable = self._num_evictable
        self.free_low_water = self.num_plain_free
        self.held.reset_peak()

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def page_hash(self, page_id: int) -> int | None:
        return self._page_hash[page_id]

    def cached_hashes(self) -> list[int]:
        """Every block hash in the index (held or evictable pages)."""
        return list(self._index)

    def free_order(self) -> list[int]:
        """Page ids with ref count 0, in the order allocation will take them."""
        return list(self._free_queue)

    # ---- prefix index ----
    def lookup(self, block_hash: int) -> int | None:
        """The page registered under ``block_hash`` (used or evictable), or None."""
        return self._index.get(block_hash)

    def register(self, page_id: int, block_hash: int) -> bool:
        """Register a held page's content under ``block_hash``.

        Returns True when the page is (now or already) registered under this hash; False when
        another page already owns the hash, in which case this page stays unregistered (the index
        never holds duplicates, and the page simply becomes plain free when released).
        """
        self._check_page(page_id)
        if self._ref_counts[page_id] == 0:
            raise RuntimeError(f"page {page_id}: only a held page can be registered")
        current = self._page_hash[page_id]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(
                    f"page {page_id} is registered under {current:#x}, cannot re-register as {block_hash:#x}"
                )
            return True
        if block_hash in self._index:
            return False
        self._index[block_hash] = page_id
        self._page_hash[page_id] = block_hash
        return True

    # ---- taking and releasing pages ----
    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages from the free queue's head, each with ref count 1.

        Evictable pages taken lose their hash (evicted). The caller checks ``num_free`` first;
        asking for more raises RuntimeError before anything changes.
        """
        if num_pages > self.num_free:
            raise RuntimeError(f"asked for {num_pages} pages, only {self.num_free} free")
        pages: list[int] = []
        for _ in range(num_pages):
            page_id = self._free_queue.popleft()
            old_hash = self._page_hash[page_id]
            if old_hash is not None:
                del self._index[old_hash]
                self._page_hash[page_id] = None
                self._num_evictable -= 1
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(page_id, old_hash)
            self._ref_counts[page_id] = 1
            pages.append(page_id)
        self.held.take(num_pages)
        free = len(self._free_queue)
        if self.num_usable - free > self.peak_used:
            self.peak_used = self.num_usable - free
        if free - self._num_evictable < self.free_low_water:
            self.free_low_water = free - self._num_evictable
        return pages

    def touch(self, page_id: int) -> None:
        """Take one more ref on a registered page (a prefix hit); an evictable one leaves the queue."""
        self._check_page(page_id)
        if self._page_hash[page_id] is None:
            raise RuntimeError(f"page {page_id}: touch needs a registered (cached) page")
        if self._ref_counts[page_id] == 0:
            self._free_queue.remove(page_id)
            self._num_evictable -= 1
            self.peak_used = max(self.peak_used, self.num_used)
            self.held.take(1)
        self._ref_counts[page_id] += 1

    def free(self, page_ids: Iterable[int], note_peak: bool = True) -> None:
        """Drop one ref on each page, in the given order.

        A page reaching ref count 0 joins the free queue: at the tail when registered (evictable,
        so the first page freed is the first evicted), at the head otherwise. ``note_peak``
        False: the caller notes the evictable peak itself once its step is done
        (``note_evictable_peak``), so that pages it evicts within that step never count.
        """
        for page_id in page_ids:
            self._check_page(page_id)
            if self._ref_counts[page_id] <= 0:
                raise RuntimeError(
                    f"page {page_id} freed with ref count {self._ref_counts[page_id]}"
                )
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                self.held.used -= 1
                if self._page_hash[page_id] is None:
                    self._free_queue.appendleft(page_id)
                else:
                    self._free_queue.append(page_id)
                    self._num_evictable += 1
        if note_peak:
            self.note_evictable_peak()

    def drop_cached(self) -> list[int]:
        """Forget every registered page (vLLM's prefix cache reset): each becomes plain free and
        no lookup finds it again. Only while no page is held (a held page's hash is what its
        request's later commits and hits rely on). Returns the hashes dropped."""
        if self.num_used:
            raise RuntimeError(f"drop_cached with {self.num_used} pages held")
        dropped = list(self._index)
        for page_id in self._index.values():
            self._page_hash[page_id] = None
            # (plain free pages are handed out first: move it to the head, as free() would put it)
            self._free_queue.remove(page_id)
            self._free_queue.appendleft(page_id)
        self._index.clear()
        self._num_evictable = 0
        return dropped

    def note_evictable_peak(self) -> None:
        self.peak_evictable = max(self.peak_evictable, self._num_evictable)

    def _check_page(self, page_id: int) -> None:
        if page_id == NULL_PAGE or not 0 < page_id < self.num_pages:
            raise ValueError(f"page id {page_id} is not a usable page (1..{self.num_pages - 1})")

    # ---- invariants ----
    def check_integrity(self, holders: Counter[int], name: str = "pool") -> None:
        """Verify the accounting against ``holders`` (page id -> number of requests holding it).

        Raises RuntimeError naming the first broken invariant.
        """

        def fail(msg: str) -> None:
            raise RuntimeError(f"{name}: {msg}")

        try:
            self._free_queue.check_integrity()
        except RuntimeError as e:
            fail(str(e))
        if self._ref_counts[NULL_PAGE] != 0 or self._page_hash[NULL_PAGE] is not None:
            fail("the null page was taken or registered")
        if NULL_PAGE in self._free_queue or NULL_PAGE in holders:
            fail("the null page is in the free queue or held by a request")
        for page_id in range(1, self.num_pages):
            if self._ref_counts[page_id] != holders.get(page_id, 0):
                fail(
                    f"page {page_id} has ref count {self._ref_counts[page_id]} "
                    f"but {holders.get(page_id, 0)} holders"
                )
            if (self._ref_counts[page_id] == 0) != (page_id in self._free_queue):
                fail(
                    f"page {page_id}: ref count {self._ref_counts[page_id]} vs free queue membership"
                )
        for block_hash, page_id in self._index.items():
            if self._page_hash[page_id] != block_hash:
                fail(
                    f"index maps {block_hash:#x} to page {page_id}, whose hash is {self._page_hash[page_id]}"
                )
        registered = sum(h is not None for h in self._page_hash)
        if registered != len(self._index):
            fail(f"{registered} pages carry a hash but the index has {len(self._index)} entries")
        evictable = sum(1 for p in self._free_queue if self._page_hash[p] is not None)
        if evictable != self._num_evictable:
            fail(f"evictable count {self._num_evictable}, found {evictable}")
        used = sum(1 for p in range(1, self.num_pages) if self._ref_counts[p] > 0)
        if used + self.num_free != self.num_usable:
            fail(f"free {self.num_free} + used {used} != usable {self.num_usable}")
        if self.peak_used < used:
            fail(f"peak used {self.peak_used} below current usage {used}")
        if self.peak_evictable < evictable:
            fail(f"peak evictable {self.peak_evictable} below current {evictable}")
        if self.free_low_water > self.num_plain_free:
            fail(f"free low-water {self.free_low_water} above current {self.num_plain_free}")
