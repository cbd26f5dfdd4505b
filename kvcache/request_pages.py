"""What one live request holds in a KV cache manager: its pages per group and its block hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.page_pool import PagePool


@dataclass
class RequestPages:
    """Pages held by one request (one ref each), in token order, plus its reuse bookkeeping.

    ``block_hashes[i]`` is the chained hash of page i's tokens (computed lazily, only for full pages);
    the first ``num_committed_pages`` pages were offered to the prefix index (each is registered under
    its hash, or unregistered when another page already owned that hash).
    """

    pages: dict[str, list[int]]  # group -> page ids, in token order
    block_hashes: list[int] = field(default_factory=list)
    num_committed_pages: int = 0

    @property
    def num_pages(self) -> int:
        """Pages held per group (every group holds the same number)."""
        return len(next(iter(self.pages.values())))

    def check(self, request_id: str, group: str, pool: PagePool) -> None:
        """Raise RuntimeError if this request's pages of ``group`` are inconsistent with ``pool``."""
        pages = self.pages[group]
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"{group}: request {request_id!r} holds a page twice: {pages}")
        if len(pages) != self.num_pages:
            raise RuntimeError(
                f"{group}: request {request_id!r} holds {len(pages)} pages, other groups {self.num_pages}"
            )
        if self.num_committed_pages > min(len(pages), len(self.block_hashes)):
            raise RuntimeError(
                f"{group}: request {request_id!r} committed more pages than it hashed/holds"
            )
        for i, page_id in enumerate(pages):
            h = pool.page_hash(page_id)
            # A committed page carries its own block hash or none (a duplicate); a later page none.
            if h is not None and (i >= self.num_committed_pages or h != self.block_hashes[i]):
                raise RuntimeError(
                    f"{group}: request {request_id!r} page {page_id} (#{i}) carries a foreign hash"
                )
