"""What one live request holds in a KV cache manager: its pages per group and its block hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.page_pool import PagePool
from kvcache.spec import NULL_PAGE


@dataclass
class RequestPages:
    """Pages held by one request (one ref each), in token order, plus its reuse bookkeeping.

    Every group's list has one entry per page of the context (entry i: tokens i*page_size ..
    (i+1)*page_size - 1), so all lists have the same length. A sliding-window group's first
    ``first_live[g]`` entries are the null page: positions whose page left the window (released) or
    was never taken; every later entry is a held page. Full-attention groups hold every entry.

    ``block_hashes[i]`` is the chained hash of page i's tokens (computed lazily, only for full
    pages). In group g, entries before ``num_committed[g]`` were offered to the prefix index (each
    held one is registered under its hash, or unregistered when another page already owned that
    hash). ``prompt_done`` is set by the commit that says the prompt is computed.
    """

    pages: dict[str, list[int]]  # group -> page ids, in token order
    first_live: dict[str, int]
    num_committed: dict[str, int]
    block_hashes: list[int] = field(default_factory=list)
    prompt_done: bool = False

    @classmethod
    def empty(cls, groups: list[str]) -> RequestPages:
        return cls({g: [] for g in groups}, dict.fromkeys(groups, 0), dict.fromkeys(groups, 0))

    @property
    def num_pages(self) -> int:
        """Entries per group list (every group has the same number): pages of the context."""
        return len(next(iter(self.pages.values())))

    def held(self, group: str) -> list[int]:
        """The page ids of ``group`` this request holds a ref on, in token order."""
        return self.pages[group][self.first_live[group] :]

    def check(self, request_id: str, group: str, pool: PagePool, windowed: bool) -> None:
        """Raise RuntimeError if this request's pages of ``group`` are inconsistent with ``pool``."""
        pages, first = self.pages[group], self.first_live[group]
        where = f"{group}: request {request_id!r}"
        if len(pages) != self.num_pages:
            raise RuntimeError(f"{where} has {len(pages)} entries, other groups {self.num_pages}")
        if first and not windowed:
            raise RuntimeError(f"{where}: a full-attention group released pages")
        if any(p != NULL_PAGE for p in pages[:first]) or NULL_PAGE in pages[first:]:
            raise RuntimeError(f"{where}: null pages are not exactly the first {first}: {pages}")
        held = pages[first:]
        if len(set(held)) != len(held):
            raise RuntimeError(f"{where} holds a page twice: {pages}")
        committed = self.num_committed[group]
        if committed > min(len(pages), len(self.block_hashes)):
            raise RuntimeError(f"{where} committed more pages than it hashed/holds")
        for i in range(first, len(pages)):
            h = pool.page_hash(pages[i])
            # A committed page carries its own block hash or none (a duplicate); a later page none.
            if h is not None and (i >= committed or h != self.block_hashes[i]):
                raise RuntimeError(f"{where} page {pages[i]} (#{i}) carries a foreign hash")
