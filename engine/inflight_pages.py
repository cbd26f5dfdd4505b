"""Pages that running prefills are computing now, so that a waiting request sharing them can wait
for them to land in the prefix cache instead of computing the same KV a second time."""

from __future__ import annotations

from engine.request import Request
from kvcache.block_hash import hash_block, hash_full_pages
from kvcache.prefix_match import PrefixMatch


class InFlightPages:
    """Chained block hash -> id of the running request computing that page (its prefill is not done).

    The hashes are the prefix cache's own (kvcache.block_hash), so "in flight" and "cached" speak of
    the same pages: a waiting request whose first uncached page is in flight will find it cached
    (committed) once the owner's prefill gets there.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._owner: dict[int, str] = {}
        self._hashes: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._hashes

    def add(self, request: Request, prefix: PrefixMatch) -> None:
        """Record the full pages ``request`` computes after ``prefix`` (called at its admission)."""
        parent = prefix.block_hashes[-1] if prefix.block_hashes else None
        hashes = hash_full_pages(
            request.all_token_ids[prefix.num_tokens :], self.page_size, parent_hash=parent
        )
        mine = [
            h for h in hashes if self._owner.setdefault(h, request.request_id) == request.request_id
        ]
        if mine:
            self._hashes[request.request_id] = mine

    def drop(self, request_id: str) -> None:
        """Forget a request's pages: its prefill is done (pages committed) or it left the running set."""
        for h in self._hashes.pop(request_id, ()):
            del self._owner[h]

    def first_uncached_page_in_flight(self, request: Request, prefix: PrefixMatch) -> bool:
        """Whether the first full page after ``prefix`` is being computed by another request."""
        if not self._owner:
            return False
        start = prefix.num_tokens
        if start + self.page_size >= len(request.all_token_ids):
            # No full page left to share: a prefix hit leaves at least the last token to
            # compute, so a page ending at the last token is never one.
            return False
        parent = prefix.block_hashes[-1] if prefix.block_hashes else None
        owner = self._owner.get(
            hash_block(parent, request.all_token_ids[start : start + self.page_size])
        )
        return owner is not None and owner != request.request_id
