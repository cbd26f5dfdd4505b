"""HostOffload: the host tier as a KV cache manager's device pools see it.

A registered page an allocation evicts is offloaded to host memory beneath its group and stays
findable; a prefix hit on it takes a device page and loads it back (kvcache/host_tier.py says when
the copies run and land). This class keeps the two sides in step: it pins a prefix's host pages
before the allocation that takes their device pages can evict (and offload) anything, stages
their copies, and hands back the load-backs that landed, which the manager then registers in the
device index; until then their request is ``loading`` and must not compute.

Pages and refs stay the manager's (kvcache/manager.py): this class takes device pages only for
load-backs, in the allocation that planned them, and never frees one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvcache.host_pool import HostPool
from kvcache.host_tier import HostTier, LoadItem
from kvcache.kv_events import KVEventLog
from kvcache.page_pool import PagePool
from kvcache.prefix_match import PrefixMatch
from kvcache.request_pages import RequestPages
from kvcache.spec import PoolGroupSpec
from kvcache.stats import HostTierStats


class HostOffload:
    def __init__(
        self,
        specs: list[PoolGroupSpec],
        pages_per_group: dict[str, int],
        device_pools: dict[str, PagePool],
        device_buffers: dict[str, torch.Tensor],
        device: torch.device,
        events: KVEventLog,
    ) -> None:
        """``pages_per_group``: host pages of every group (>= 1 each); ``device_pools`` and
        ``device_buffers``: the manager's, by group."""
        names = [s.name for s in specs]
        if set(pages_per_group) != set(names):
            raise ValueError(f"host_tier_pages must name the groups {names}, got {pages_per_group}")
        self.tier = HostTier(specs, pages_per_group, device_buffers, device, events)
        self._device_pools = device_pools

    @property
    def pools(self) -> dict[str, HostPool]:
        """Group -> its host pages' accounting (what ``match_prefix`` searches beneath a pool)."""
        return self.tier.pools

    # ---- offloads ----
    def offload(self, group: str, device_page: int, block_hash: int) -> None:
        """A device pool evicted ``device_page`` (its KV still intact) to hand it out."""
        self.tier.offload(group, device_page, block_hash)

    # ---- load-backs ----
    def take_loads(
        self, prefix: PrefixMatch, loads: Mapping[str, list[int]], state: RequestPages
    ) -> int:
        """Load back the prefix's host pages at ``loads`` (group -> positions in the prefix, in
        order) into fresh device pages, which go into ``state``'s page lists at those positions.
        Every host page is pinned before any device page is taken: taking one may evict, and so
        offload, which must not drop a page about to be read. The copies run at
        ``finish_allocation``. Returns how many prefix positions are loaded back (in any group)."""
        for g, positions in loads.items():
            for i in positions:
                self.tier.pin(g, prefix.host_pages[g][i])
        for g, positions in loads.items():
            pages = state.pages[g]
            for i, device_page in zip(positions, self._device_pools[g].allocate(len(positions))):
                pages[i] = device_page
                item = LoadItem(g, prefix.host_pages[g][i], device_page, prefix.block_hashes[i])
                self.tier.stage_load(item)
        return len({i for positions in loads.values() for i in positions})

    def finish_allocation(self, request_id: str) -> list[LoadItem]:
        """End of one ``allocate_slots``: order its offloads before the model's next writes, copy
        its staged load-backs; return those that landed already (on a CPU worker, all)."""
        return self.tier.finish_allocation(request_id)

    def poll(self) -> list[LoadItem]:
        """Every load-back whose copy finished, landed."""
        return self.tier.poll()

    def loading(self, request_id: str) -> bool:
        """Whether ``request_id``'s load-backs are still being copied."""
        return self.tier.loading(request_id)

    def wait(self, request_id: str) -> list[LoadItem]:
        """Block until ``request_id``'s own load-backs finished; return them, landed."""
        return self.tier.wait(request_id)

    def wait_offloads(self) -> None:
        """Block until every queued offload read its device page."""
        self.tier.wait_offloads()

    def drop_cached(self) -> dict[str, list[int]]:
        """Forget every group's cached host pages (no load-back may be in flight); group -> the
        hashes dropped."""
        return {g: pool.drop_cached() for g, pool in self.tier.pools.items()}

    # ---- queries ----
    def cached_hashes(self, group: str) -> list[int]:
        """Every block hash of ``group`` findable on the host now."""
        return self.tier.pools[group].cached_hashes()

    def stats(self, group: str, page_size: int) -> HostTierStats:
        return self.tier.pools[group].stats(page_size)

    def check_integrity(self, requests: Mapping[str, RequestPages]) -> None:
        """The tier's own invariants, and that a page being loaded back is held by its request
        (``requests``: the manager's) and not findable on the device before it lands."""
        self.tier.check_integrity()
        for rid, items in self.tier.pending_loads().items():
            state = requests.get(rid)
            for item in items:
                if state is None or item.device_page not in state.held(item.group):
                    raise RuntimeError(f"load-back {item} of {rid!r}: the page is not held by it")
                if self._device_pools[item.group].page_hash(item.device_page) is not None:
                    raise RuntimeError(f"load-back {item} of {rid!r}: registered before it landed")
