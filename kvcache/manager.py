"""KVCacheManager: which pages each request holds, prefix reuse, and the KV storage.

Layering (as in vLLM v1): the scheduler talks to this manager in tokens and request ids; the manager
turns tokens into pages and drives one ``PagePool`` per pool group. Groups share one page size, and
a request's page list in every group has one entry per page of its context (kvcache/spec.py): a
full-attention group holds all of them, a sliding-window group only those its window still reads
plus the page being written, the rest showing the null page.

Window groups release pages as the request runs: ``allocate_slots(..., num_computed_tokens=c)``
drops the pages wholly before c - W + 1 (in chunked prefill and in decode alike). A released page
that was committed stays in the prefix index as evictable, so a later request can still hit it.

SWA scratch reuse (``swa_scratch_reuse=True``): while a request's prompt is not done, a window page
that leaves the window is rewritten in place as one of the request's next pages instead of going
back to the pool and a fresh page being taken. A long prefill then touches about
(window + chunk) / page_size pages of the group, whatever the prompt length, and leaves no trail of
cached pages behind it that would evict other requests' prefixes. What reuse loses: window pages
are not committed before the prompt is done (their content is about to be overwritten), so the only
prefix hits such a prompt leaves in a window group are at its end (the last window, committed when
the prompt is done, and what decode adds after); a later request sharing only part of a long prompt
misses in the window group and so recomputes from the start, where without scratch reuse it would
hit at any page boundary (while the pages last). Pages shared through a prefix hit or registered in
the index are never rewritten; they are released as usual.

Host tier (``host_tier_pages``): evicted registered pages are offloaded to host memory and loaded
back on a prefix hit (kvcache/host_offload.py). A loaded page is registered in the device index
when its copy landed; until then the request is ``loads_pending`` and must not compute.

KV events (``enable_events``): every change to what ``match_prefix`` can find, by tier and block
hash (kvcache/kv_events.py), drained by the worker that publishes them.

Ownership: a request owns one ref on each non-null page listed by ``page_ids(request_id)`` from the
``allocate_slots`` that gave it until ``free(request_id)`` (or until a later ``allocate_slots``
releases it from a window). Pinning a page (e.g. for a transfer lease) means not calling ``free``
yet. Not thread-safe: one owner (the worker's step loop) calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import weakref
from collections import Counter
from collections.abc import Iterator

import torch

from kvcache.block_hash import hash_full_pages
from kvcache.group_allocation import GroupPlan, extend_pages, plan_group, release_pages
from kvcache.host_offload import HostOffload
from kvcache.host_tier import HostTier, LoadItem
from kvcache.kv_buffer import allocate_buffers, layer_views
from kvcache.kv_events import KVEvent, KVEventLog, Medium
from kvcache.page_pool import PagePool, PagesHeld
from kvcache.prefix_match import PrefixMatch, check_prefix, find_cached_prefix
from kvcache.request_pages import RequestPages
from kvcache.reuse_policy import ReusePolicy
from kvcache.sliding_window import max_pages_held, release_point
from kvcache.spec import NULL_PAGE, PoolGroupSpec
from kvcache.stats import KVCacheStats, ReuseCounters

NO_RELEASE = sys.maxsize  # ``next_release_at`` of a request no window will ever release from


class KVCacheManager:
    """Paged KV cache of one worker (docs/contracts.md, "kvcache.KVCacheManager")."""

    def __init__(
        self,
        specs: list[PoolGroupSpec],
        reuse_policy: ReusePolicy | str = ReusePolicy.NONE,
        device: torch.device | str = "cpu",
        swa_scratch_reuse: bool = False,
        host_tier_pages: dict[str, int] | None = None,
    ) -> None:
        """Build the pools and allocate the storage.

        Args:
            specs: one spec per pool group (unique names, disjoint layer ids, equal page sizes).
            reuse_policy: prefix reuse policy (a ReusePolicy or its string value).
            device: where the storage tensors live.
            swa_scratch_reuse: rewrite a prefill's out-of-window pages in place (module docstring).
            host_tier_pages: host-tier pages per group (every group, >= 1 each); None: no tier.
        """
        if not specs:
            raise ValueError("KVCacheManager needs at least one pool group spec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"pool group names must be unique, got {names}")
        page_sizes = {s.page_size for s in specs}
        if len(page_sizes) != 1:
            raise ValueError(f"all pool groups must share one page_size, got {sorted(page_sizes)}")
        self.page_size: int = specs[0].page_size
        self.reuse_policy = ReusePolicy(reuse_policy)
        self.swa_scratch_reuse = swa_scratch_reuse
        self.device = torch.device(device)
        self.specs: dict[str, PoolGroupSpec] = {s.name: s for s in specs}
        self.windows: dict[str, int | None] = {s.name: s.sliding_window for s in specs}
        self.buffers: dict[str, torch.Tensor] = allocate_buffers(specs, self.device)
        self._layer_views = layer_views(specs, self.buffers)
        self._held = PagesHeld()  # every group's used pages together, and their peak
        self._pools: dict[str, PagePool] = {
            s.name: PagePool(s.num_pages, self._held) for s in specs
        }
        self._windowed = [g for g, w in self.windows.items() if w is not None]
        self._requests: dict[str, RequestPages] = {}
        self._reuse = ReuseCounters()
        self.events = KVEventLog()
        self._host: HostOffload | None = None
        if host_tier_pages is not None:
            self._host = HostOffload(
                specs, host_tier_pages, self._pools, self.buffers, self.device, self.events
            )
        self.host_tier: HostTier | None = self._host.tier if self._host is not None else None
        # Weakly: a pool that held its manager would make a cycle, and the device memory of a
        # dropped engine's KV cache would wait for the garbage collector (an engine built after
        # it then finds too little free memory and sizes a small cache).
        me = weakref.ref(self)
        for g, pool in self._pools.items():
            pool.on_evict = functools.partial(_evict_hook, me, g)

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
    def match_prefix(self, token_ids: list[int], read: bool = True) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, in whole pages, that every group can serve
        (kvcache/prefix_match.py says what a window group must hold for a hit).

        Pure lookup: takes no refs and changes no state. At least one token is always left to
        compute, so ``num_tokens <= len(token_ids) - 1`` (an exact multiple of page_size loses its last
        page). Empty under ``ReusePolicy.NONE``, and with ``read`` False (a request that must
        compute every position; its pages are still cached for others once committed).
        """
        n = len(token_ids)
        if not self.reuse_policy.reuses or n <= 1 or not read:
            return PrefixMatch(0, {g: [] for g in self._pools}, [], n)
        host = self._host.pools if self._host is not None else None
        return find_cached_prefix(token_ids, self.page_size, self._pools, self.windows, host)

    # ---- allocation ----
    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        prefix: PrefixMatch | None = None,
        num_computed_tokens: int | None = None,
        count_reuse: bool = True,
    ) -> bool:
        """Make ``request_id`` hold pages for ``num_total_tokens`` tokens (its whole context so far).

        ``num_computed_tokens``: tokens whose KV is written (the next step's first query sits
        there); window groups then hold only pages from the window before it on, releasing held
        pages wholly before (never taken again: a later smaller value changes nothing). None: the
        prefix's tokens on a request's first call, no release on later calls.

        On a request's first call (it holds nothing yet; also the first call after ``free``), the
        ``prefix`` pages are taken first (ref +1 each; an evictable page leaves the free queue) and
        counted in the reuse stats (unless ``count_reuse`` is False: a preempted request's new
        query, which vLLM counts apart and Duet not at all, so a request is one query); pass the
        match even when empty so the query is counted. On later calls ``prefix`` is ignored. Holding more pages than needed already is fine (never shrinks).

        All or nothing: returns False, changing nothing (no eviction, no release, no stats), when
        some group lacks free + evictable pages (counting those this call releases) for its new
        pages plus the evictable prefix pages it would take. Raises ValueError for a prefix that is
        longer than ``num_total_tokens``, past ``num_computed_tokens``, or stale (an allocation since
        ``match_prefix`` evicted one of its pages).
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        state = self._requests.get(request_id)
        taken = prefix if state is None else None
        computed = num_computed_tokens
        if computed is not None and not 0 <= computed <= num_total_tokens:
            raise ValueError(
                f"num_computed_tokens={computed} outside [0, num_total_tokens={num_total_tokens}]"
            )
        if taken is not None:
            host = self._host.pools if self._host is not None else None
            check_prefix(taken, num_total_tokens, self.page_size, self._pools, self.windows, host)
            if computed is None:
                computed = taken.num_tokens
            elif computed < taken.num_tokens:
                raise ValueError(
                    f"num_computed_tokens={computed} is below the prefix's {taken.num_tokens} tokens"
                )
        needed = -(-num_total_tokens // self.page_size)
        if state is not None and not self._windowed:  # full attention only: grow every group
            grow = needed - state.num_pages
            if grow > 0:
                if any(pool.num_free < grow for pool in self._pools.values()):
                    return False
                for g, pool in self._pools.items():
                    state.pages[g].extend(pool.allocate(grow))
                self._finish_allocation(request_id)
            return True
        plans: dict[str, GroupPlan] = {}
        for g, pool in self._pools.items():
            window, scratch = self.windows[g], self.swa_scratch_reuse
            plan = plan_group(
                g, pool, window, self.page_size, scratch, state, taken, computed, needed
            )
            if plan is None:
                return False
            plans[g] = plan
        if state is None:
            state = RequestPages.empty(list(self._pools))
            self._requests[request_id] = state
            if taken is not None:
                self._take_prefix(state, taken, plans, count_reuse)
        # Every group gives back its released pages before any takes new ones: the pages held in
        # all groups at once (their peak on /metrics) never count a page this step released.
        for g, pool in self._pools.items():
            release_pages(state, g, pool, plans[g])
        for g, pool in self._pools.items():
            extend_pages(state, g, pool, plans[g], needed)
            pool.note_evictable_peak()  # (a page released and evicted in this step never counts)
        self._finish_allocation(request_id)
        return True

    def _take_prefix(
        self,
        state: RequestPages,
        prefix: PrefixMatch,
        plans: dict[str, GroupPlan],
        count_reuse: bool,
    ) -> None:
        """Take the prefix's pages: touch its device pages, then (host tier) load back its host
        pages into new device pages."""
        loads: dict[str, list[int]] = {}  # group -> positions loaded back from the host tier
        for g, pool in self._pools.items():
            ids = prefix.page_ids.get(g, [])
            start = min(plans[g].start, len(ids))
            for p in ids[start:]:
                if p != NULL_PAGE:
                    pool.touch(p)
            state.pages[g] = [NULL_PAGE] * start + ids[start:]
            state.first_live[g] = start
            state.num_committed[g] = prefix.num_pages
            loads[g] = sorted(i for i in prefix.host_pages.get(g, {}) if i >= start)
        loaded = self._host.take_loads(prefix, loads, state) if self._host is not None else 0
        state.block_hashes = list(prefix.block_hashes)
        if count_reuse:
            self._reuse.record(prefix.num_tokens, prefix.num_query_tokens, loaded * self.page_size)

    def _finish_allocation(self, request_id: str) -> None:
        if self._host is not None:
            self._land(self._host.finish_allocation(request_id))

    # ---- the host tier (kvcache/host_offload.py) and events ----
    def _evicted(self, group: str, page: int, block_hash: int) -> None:
        """A device pool dropped ``page``'s hash to hand it out (its KV is still intact)."""
        self.events.record("removed", "device", group, block_hash)
        if self._host is not None:
            self._host.offload(group, page, block_hash)

    def _register(self, group: str, pool: PagePool, page: int, block_hash: int) -> None:
        if pool.page_hash(page) is None and pool.register(page, block_hash):
            self.events.record("stored", "device", group, block_hash)

    def _land(self, items: list[LoadItem]) -> None:
        """Loaded-back pages whose copy finished become findable on the device."""
        for item in items:
            self._register(item.group, self._pools[item.group], item.device_page, item.block_hash)

    def poll_loads(self) -> None:
        """Land every load-back whose copy finished (the scheduler calls it once per step)."""
        if self._host is not None:
            self._land(self._host.poll())

    def loads_pending(self, request_id: str) -> bool:
        """Whether ``request_id``'s load-backs from the host tier are still being copied: it must
        not compute until they land (never on a CPU worker, whose copies land at once). False
        means landed: copies that finished are landed here, so that no request computes on
        loaded pages that are not in the prefix index yet (a window would release them as plain
        free pages, and a later landing would index whatever they hold by then)."""
        if self._host is None:
            return False
        if self._host.loading(request_id):
            return True
        self._land(self._host.wait(request_id))  # (copies done, or none: this does not block)
        return False

    def wait_loads(self, request_id: str) -> None:
        """Block until ``request_id``'s own load-backs landed."""
        if self._host is not None:
            self._land(self._host.wait(request_id))

    def wait_offloads(self) -> None:
        """Block until every queued offload read its device page: call before pages this manager
        handed out are written outside the model's stream (a KV receive into them)."""
        if self._host is not None:
            self._host.wait_offloads()

    def enable_events(self) -> None:
        """Record KV events from now on (a worker that publishes them; ``cached_blocks`` first)."""
        self.events.enabled = True

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    def cached_blocks(self) -> dict[str, dict[Medium, list[int]]]:
        """Group -> medium -> every block hash ``match_prefix`` can find there now (the state that
        the events since this call continue)."""
        out: dict[str, dict[Medium, list[int]]] = {}
        for g, pool in self._pools.items():
            out[g] = {"device": pool.cached_hashes()}
            if self._host is not None:
                out[g]["host"] = self._host.cached_hashes(g)
        return out

    # ---- reuse registration ----
    def commit(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int, prompt_done: bool
    ) -> None:
        """Register the full pages among the first ``num_computed_tokens`` tokens for reuse.

        ``token_ids`` is the request's sequence from its first token (at least ``num_computed_tokens``
        long); those tokens' KV must already be written. Whether anything is registered depends on the
        policy (``none``: never; ``all_reusable``: every call; ``per_request``: when ``prompt_done``).
        Pages a window group already released are not registered (they are gone); with scratch
        reuse, window groups register nothing until the prompt is done. Idempotent: pages already
        offered are skipped. A page whose hash already belongs to another page stays unregistered
        (no duplicate index entries). Raises KeyError for an unknown request.
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
        state.prompt_done = state.prompt_done or prompt_done
        if not self.reuse_policy.registers_on_commit(prompt_done):
            return
        groups = [
            g
            for g in self._pools
            if state.num_committed[g] < num_full
            and not (self.swa_scratch_reuse and g in self._windowed and not state.prompt_done)
        ]
        if not groups:
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
        for g in groups:
            pool, pages = self._pools[g], state.pages[g]
            for i in range(max(state.num_committed[g], state.first_live[g]), num_full):
                self._register(g, pool, pages[i], state.block_hashes[i])
            state.num_committed[g] = num_full

    # ---- release ----
    def free(self, request_id: str) -> None:
        """Drop every ref ``request_id`` holds and forget it; unknown ids are a no-op (late frees).

        Pages are released last-first, so among a request's cached pages the tail of its prefix is
        evicted before the head (a prefix without its head is unreachable anyway).
        """
        if request_id not in self._requests:
            return
        if self._host is not None:  # its load-backs still write its pages: wait for its own
            self._land(self._host.wait(request_id))
        state = self._requests.pop(request_id)
        for g, pool in self._pools.items():
            pool.free(reversed(state.held(g)))

    def reset_prefix_cache(self, host_tier: bool = False) -> bool:
        """Forget every cached page (vLLM's ``reset_prefix_cache``: after new weights, or for a
        cold-cache measurement), so that no later ``match_prefix`` finds anything computed
        before; ``host_tier``: the host tier's pages too (vLLM resets its KV connector's cache,
        where an offloaded copy lives, only when asked). All or nothing, as vLLM's: False,
        changing nothing, while any request holds pages (its pages' hashes are what its own
        commits build on); True once done. Removal events for every hash forgotten."""
        if self._requests:
            return False
        for g, pool in self._pools.items():
            for block_hash in pool.drop_cached():
                self.events.record("removed", "device", g, block_hash)
        if host_tier and self._host is not None:
            for g, hashes in self._host.drop_cached().items():
                for block_hash in hashes:
                    self.events.record("removed", "host", g, block_hash)
        return True

    # ---- queries ----
    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        """Every request that holds pages now."""
        return list(self._requests)

    def page_ids(self, request_id: str) -> dict[str, list[int]]:
        """Group name -> the request's page list, one entry per page of its context in token order
        (a copy; a window group shows the null page where its pages were released). KeyError if
        unknown."""
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r} (not allocated, or already freed)")
        return {g: list(p) for g, p in state.pages.items()}

    def next_release_at(self, request_id: str) -> int:
        """The ``num_computed_tokens`` from which an ``allocate_slots`` would release a window page
        of this request (``NO_RELEASE`` when none can), so callers may skip calls before then."""
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"unknown request {request_id!r} (not allocated, or already freed)")
        if not self._windowed:
            return NO_RELEASE
        points = [
            release_point(state.first_live[g], self.specs[g].sliding_window or 0, self.page_size)
            for g in self._windowed
            if state.first_live[g] < len(state.pages[g])
        ]
        return min(points, default=NO_RELEASE)

    def max_pages_per_request(self, num_tokens: int, max_step_tokens: int) -> dict[str, int]:
        """Group -> the most pages one request of ``num_tokens`` tokens holds at once, computing at
        most ``max_step_tokens`` per step (kvcache/sliding_window.py)."""
        return {
            g: max_pages_held(num_tokens, self.page_size, w, max_step_tokens)
            for g, w in self.windows.items()
        }

    def fits_alone(self, num_tokens: int, max_step_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in every group of an empty cache."""
        need = self.max_pages_per_request(num_tokens, max_step_tokens)
        return all(need[g] <= pool.num_usable for g, pool in self._pools.items())

    def num_free_pages(self, group: str) -> int:
        """Pages of ``group`` an allocation could take now: plain free plus evictable."""
        return self._pools[group].num_free

    def stats(self) -> KVCacheStats:
        """A snapshot of page counts and interval peaks per group (and its host tier), and the
        reuse counters."""
        host = self._host
        groups = {
            g: pool.stats(self.windows[g], host.stats(g, self.page_size) if host else None)
            for g, pool in self._pools.items()
        }
        r = self._reuse
        return KVCacheStats(
            groups,
            r.queries,
            r.hit_tokens,
            r.miss_tokens,
            len(self._requests),
            r.host_hit_tokens,
            peak_used=self._held.peak,
        )

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Requests run inside leave no trace once freed: nothing registered for reuse (the
        policy is ``none`` meanwhile), the reuse counters as they were before, the peaks reset. For
        the engine's warm-up request; raises RuntimeError if a request of it is still held."""
        policy, counters = self.reuse_policy, dataclasses.replace(self._reuse)
        held = set(self._requests)
        self.reuse_policy = ReusePolicy.NONE
        try:
            yield
        finally:
            self.reuse_policy, self._reuse = policy, counters
            self.reset_peak()
        left = set(self._requests) - held
        if left:
            raise RuntimeError(f"requests still hold pages after an unrecorded run: {sorted(left)}")

    def reset_peak(self) -> None:
        """Start a new stats interval: every group's peaks (used, evictable, free low-water) and
        the peak of all groups' used pages together become the current counts."""
        for pool in self._pools.values():
            pool.reset_peaks()

    def check_integrity(self) -> None:
        """Verify every accounting invariant of every group; raise RuntimeError naming the first
        one broken."""
        for g, pool in self._pools.items():
            holders: Counter[int] = Counter()
            for rid, state in self._requests.items():
                state.check(rid, g, pool, windowed=self.windows[g] is not None)
                holders.update(state.held(g))
            pool.check_integrity(holders, name=f"pool group {g!r}")
        used = sum(pool.num_used for pool in self._pools.values())
        if self._held.used != used:
            raise RuntimeError(f"pages held in all groups counted {self._held.used}, found {used}")
        if self._held.peak < used:
            raise RuntimeError(f"peak of pages held in all groups {self._held.peak} below {used}")
        if self._host is not None:
            self._host.check_integrity(self._requests)


def _evict_hook(
    manager: weakref.ref[KVCacheManager], group: str, page: int, block_hash: int
) -> None:
    m = manager()
    if m is not None:
        m._evicted(group, page, block_hash)
