"""KVCacheManager: which pages each request holds, prefix reuse, and the KV storage.

Layering (as in vLLM v1): the scheduler talks to this manager in tokens and request ids; the manager
turns tokens into pages and drives one ``PagePool`` per pool group. All groups are full attention and
share one page size, so a request holds the same number of pages in every group.

Ownership: a request owns one ref on each page listed by ``page_ids(request_id)`` from the
``allocate_slots`` that gave it until ``free(request_id)``. Pinning a page (e.g. for a transfer lease)
means not calling ``free`` yet. Not thread-safe: one owner (the worker's step loop) calls it.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvcache.block_hash import hash_block, hash_full_pages
from kvcache.kv_buffer import allocate_buffers, layer_views
from kvcache.page_pool import PagePool
from kvcache.prefix_match import PrefixMatch
from kvcache.request_pages import RequestPages
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import PoolGroupSpec
from kvcache.stats import KVCacheStats, PoolGroupStats, ReuseCounters


class KVCacheManager:
    """Paged KV cache of one worker (docs/contracts.md, "kvcache.KVCacheManager")."""

    def __init__(
        self,
        specs: list[PoolGroupSpec],
        reuse_policy: ReusePolicy | str = ReusePolicy.NONE,
        device: torch.device | str = "cpu",
    ) -> None:
        """Build the pools and allocate the storage.

        Args:
            specs: one spec per pool group (unique names, disjoint layer ids, equal page sizes).
            reuse_policy: prefix reuse policy (a ReusePolicy or its string value).
            device: where the storage tensors live.
        """
        if not specs:
            raise ValueError("KVCacheManager needs at least one pool group spec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"pool group names must be unique, got {names}")
        for s in specs:
            if s.sliding_window is not None:
                raise NotImplementedError(
                    f"pool group {s.name!r} has sliding_window={s.sliding_window}: sliding-window "
                    "groups are not supported yet; only full attention (sliding_window=None)"
                )
        page_sizes = {s.page_size for s in specs}
        if len(page_sizes) != 1:
            raise ValueError(f"all pool groups must share one page_size, got {sorted(page_sizes)}")
        self.page_size: int = specs[0].page_size
        self.reuse_policy = ReusePolicy(reuse_policy)
        self.device = torch.device(device)
        self.specs: dict[str, PoolGroupSpec] = {s.name: s for s in specs}
        self.buffers: dict[str, torch.Tensor] = allocate_buffers(specs, self.device)
        self._layer_views = layer_views(specs, self.buffers)
        self._pools: dict[str, PagePool] = {s.name: PagePool(s.num_pages) for s in specs}
        self._requests: dict[str, RequestPages] = {}
        self._peak_used: dict[str, int] = {name: 0 for name in names}
        self._reuse = ReuseCounters()

    # ---- storage ----
    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of model layer ``layer_id``: views [num_pages, page_size, Hkv, D]."""
        try:
            return self._layer_views[layer_id]
        except KeyError:
            raise KeyError(
                f"layer {layer_id} is in no pool group (known: {sorted(self._layer_views)})"
            ) from None

    # ---- prefix reuse ----
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, in whole pages, present in every pool group.

        Pure lookup: takes no refs and changes no state. At least one token is always left to
        compute, so ``num_tokens <= len(token_ids) - 1`` (an exact multiple of page_size loses its last
        page). Empty under ``ReusePolicy.NONE``.
        """
        n = len(token_ids)
        if not self.reuse_policy.reuses or n <= 1:
            return PrefixMatch(0, {g: [] for g in self._pools}, [], n)
        max_pages = (n - 1) // self.page_size
        pages: dict[str, list[int]] = {g: [] for g in self._pools}
        hashes: list[int] = []
        parent: int | None = None
        ps = self.page_size
        for i in range(max_pages):
            block_hash = hash_block(parent, token_ids[i * ps : (i + 1) * ps])
            hit = [(g, pool.lookup(block_hash)) for g, pool in self._pools.items()]
            if any(p is None for _, p in hit):
                break
            for g, p in hit:
                pages[g].append(p)  # type: ignore[arg-type]  # not None, checked above
            hashes.append(block_hash)
            parent = block_hash
        return PrefixMatch(len(hashes) * self.page_size, pages, hashes, n)

    # ---- allocation ----
    def allocate_slots(
        self, request_id: str, num_total_tokens: int, prefix: PrefixMatch | None = None
    ) -> bool:
        """Make ``request_id`` hold pages for ``num_total_tokens`` tokens (its whole context so far).

        On a request's first call (it holds nothing yet; also the first call after ``free``), the
        ``prefix`` pages are taken first (ref +1 each; an evictable page leaves the free queue) and
        counted in the reuse stats; pass the match even when empty so the query is counted. On later
        calls ``prefix`` is ignored. Holding more pages than needed already is fine (never shrinks).

        All or nothing: returns False, changing nothing (no eviction, no stats), when some group
        lacks free + evictable pages for the new pages plus the evictable prefix pages it would take.
        Raises ValueError for a prefix that is longer than ``num_total_tokens`` or stale (an
        allocation since ``match_prefix`` evicted one of its pages).
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        state = self._requests.get(request_id)
        held = 0 if state is None else state.num_pages
        taken = prefix if state is None and prefix is not None else None
        if taken is not None:
            self._check_prefix(taken, num_total_tokens)
        prefix_pages = 0 if taken is None else taken.num_pages
        needed = -(-num_total_tokens // self.page_size)
        new_pages = max(0, needed - held - prefix_pages)
        for g, pool in self._pools.items():
            # Evictable prefix pages leave the free queue when taken, so they need room too.
            cached = [] if taken is None else taken.page_ids.get(g, [])
            cached_to_take = sum(1 for p in cached if pool.ref_count(p) == 0)
            if new_pages + cached_to_take > pool.num_free:
                return False
        if state is None:
            state = RequestPages(pages={g: [] for g in self._pools})
            self._requests[request_id] = state
            if taken is not None:
                for g, pool in self._pools.items():
                    for p in taken.page_ids.get(g, []):
                        pool.touch(p)
                        state.pages[g].append(p)
                state.block_hashes = list(taken.block_hashes)
                state.num_committed_pages = taken.num_pages
                self._reuse.record(taken.num_tokens, taken.num_query_tokens)
        for g, pool in self._pools.items():
            state.pages[g].extend(pool.allocate(new_pages))
            self._peak_used[g] = max(self._peak_used[g], pool.num_used)
        return True

    def _check_prefix(self, prefix: PrefixMatch, num_total_tokens: int) -> None:
        if prefix.num_tokens != prefix.num_pages * self.page_size:
            raise ValueError(
                f"prefix covers {prefix.num_tokens} tokens but has {prefix.num_pages} pages"
            )
        if prefix.num_tokens > num_total_tokens:
            raise ValueError(
                f"prefix of {prefix.num_tokens} tokens exceeds num_total_tokens={num_total_tokens}"
            )
        if not prefix.num_pages:
            return
        for g, pool in self._pools.items():
            ids = prefix.page_ids.get(g, [])
            if len(ids) != prefix.num_pages:
                raise ValueError(
                    f"prefix has {len(ids)} pages for group {g!r}, expected {prefix.num_pages}"
                )
            for p, h in zip(ids, prefix.block_hashes, strict=True):
                if pool.lookup(h) != p:
                    raise ValueError(
                        f"stale PrefixMatch: page {p} of group {g!r} no longer holds block {h:#x}; "
                        "call match_prefix right before allocate_slots"
                    )

    # ---- reuse registration ----
    def commit(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int, prompt_done: bool
    ) -> None:
        """Register the full pages among the first ``num_computed_tokens`` tokens for reuse.

        ``token_ids`` is the request's sequence from its first token (at least ``num_computed_tokens``
        long); those tokens' KV must already be written. Whether anything is registered depends on the
        policy (``none``: never; ``all_reusable``: every call; ``per_request``: when ``prompt_done``).
        Idempotent: pages already offered are skipped. A page whose hash already belongs to another
        page stays unregistered (no duplicate index entries). Raises KeyError for an unknown request.
        """
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(
                f"commit for unknown request {request_id!r} (not allocated, or already freed)"
            )
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} outside [0, len(token_ids)={len(token_ids)}]"
            )
        num_full = num_computed_tokens // self.page_size
        if num_full > state.num_pages:
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed tokens need {num_full} pages, "
                f"it holds {state.num_pages}"
            )
        if (
            not self.reuse_policy.registers_on_commit(prompt_done)
            or num_full <= state.num_committed_pages
        ):
            return
        known = len(state.block_hashes)
        if num_full > known:
            parent = state.block_hashes[-1] if known else None
            state.block_hashes.extend(
                hash_full_pages(
                    token_ids[known * self.page_size : num_full * self.page_size],
                    self.page_size,
                    parent_hash=parent,
                )
            )
        for i in range(state.num_committed_pages, num_full):
            for g, pool in self._pools.items():
                pool.register(state.pages[g][i], state.block_hashes[i])
        state.num_committed_pages = num_full

    # ---- release ----
    def free(self, request_id: str) -> None:
        """Drop every ref ``request_id`` holds and forget it; unknown ids are a no-op (late frees).

        Pages are released last-first, so among a request's cached pages the tail of its prefix is
        evicted before the head (a prefix without its head is unreachable anyway).
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for g, pool in self._pools.items():
            pool.free(reversed(state.pages[g]))

    # ---- queries ----
    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def page_ids(self, request_id: str) -> dict[str, list[int]]:
        """Group name -> page ids held by the request, in token order (a copy). KeyError if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r} (not allocated, or already freed)")
        return {g: list(p) for g, p in state.pages.items()}

    def num_free_pages(self, group: str) -> int:
        """Pages of ``group`` an allocation could take now: plain free plus evictable."""
        return self._pools[group].num_free

    def stats(self) -> KVCacheStats:
        """A snapshot of page counts per group and the reuse counters."""
        groups = {
            g: PoolGroupStats(
                total=pool.num_usable,
                free=pool.num_free,
                used=pool.num_used,
                evictable=pool.num_evictable,
                peak_used=self._peak_used[g],
                evictions=pool.num_evictions,
            )
            for g, pool in self._pools.items()
        }
        r = self._reuse
        return KVCacheStats(groups, r.queries, r.hit_tokens, r.miss_tokens, 0, len(self._requests))

    def reset_peak(self) -> None:
        """Start a new stats interval: each group's peak becomes its current usage."""
        for g, pool in self._pools.items():
            self._peak_used[g] = pool.num_used

    def check_integrity(self) -> None:
        """Verify every accounting invariant; raise RuntimeError naming the first one broken."""
        for g, pool in self._pools.items():
            holders: Counter[int] = Counter()
            for rid, state in self._requests.items():
                state.check(rid, g, pool)
                holders.update(state.pages[g])
            pool.check_integrity(holders, name=f"pool group {g!r}")
            if self._peak_used[g] < pool.num_used:
                raise RuntimeError(
                    f"{g}: peak {self._peak_used[g]} below current usage {pool.num_used}"
                )
