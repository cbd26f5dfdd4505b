"""NativeRoute: how the direct reads from one peer's pools into ours launch through the C launcher
(transfer/direct_copy.py), and the checks that what the launcher found out about the ids allows.

A read's general checks (plan.checked_direct_plan, lease_board.lease_digest on arrays made from
the ticket) rebuild what the launch already has: the pool pairs, the ids in the pinned slot, their
bounds and repeats. On a core that just woke up they cost 50-70 us, as long as the copy of 16 MiB,
on the latency path (docs/benchmarks/transfer.md, fourteenth pass). Here the same answers come
from the route, made once per peer, and from the slot: the pool pairs are the matched ones by
construction, ids are plainly valid from their bounds, and the lease digest hashes the slot's ids
in place. Anything else (skipped pages, ids out of bounds or repeated) takes the general checks,
which say what is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transfer.lease_board import digest_of
from transfer.page_table import PageTable
from transfer.plan import plainly_valid


class NativeRoute:
    """(source pool, destination pool, C handle) per matched pool pair, in P's pool order, with
    what the quick checks need of each pair."""

    def __init__(
        self, pairs: tuple[tuple[str, str, Any], ...], src: PageTable, dst: PageTable
    ) -> None:
        self.pairs = pairs
        self.names = frozenset(sp for sp, _, _ in pairs)
        self.compat_hash = dst.compat_hash  # ours: a ticket must carry it (pull_checks)
        # (source pages, destination pages, bytes a page) per pair, in launch order
        self._bounds = tuple(
            (src.pool(sp).num_pages, dst.pool(dp).num_pages, src.pool(sp).page_bytes)
            for sp, dp, _ in pairs
        )
        # (source pool, launch index) in name order, as lease_digest hashes pools
        self._digest_order = tuple(sorted((sp, k) for k, (sp, _, _) in enumerate(pairs)))

    def plain_bytes(self, stats: tuple[tuple[int, ...], ...]) -> int | None:
        """The bytes a launch moves when the launcher found every pair's ids plainly valid (each
        in its pool, no null page, no destination page twice: what plan.checked_ids would pass
        unchanged); None otherwise."""
        total = 0
        for one, (s_pages, d_pages, page_bytes) in zip(stats, self._bounds):
            if not plainly_valid(one[1:], s_pages, d_pages):
                return None
            total += one[0] * page_bytes
        return total

    def digest(
        self, request_id: str, src_ids: np.ndarray, stats: tuple[tuple[int, ...], ...]
    ) -> bytes:
        """lease_board.lease_digest of ``request_id`` and the source ids of a launch that skipped
        no page (then those are the ticket's), read in place from the slot's row ``src_ids``."""
        at, runs = 0, []
        for one in stats:
            runs.append(at)
            at += one[0] + one[0] % 2
        return digest_of(
            request_id,
            ((sp, src_ids[runs[k] : runs[k] + stats[k][0]]) for sp, k in self._digest_order),
        )
