"""HostTier: host memory beneath each device pool group, for reusable pages the device evicts.

An evictable (registered) device page that an allocation evicts is copied here (offloaded) and
stays findable by its block hash on medium "host"; a prefix hit on such a page allocates a device
page and copies the page back (a load-back) before the request computes. Window groups take part
like full groups: their evicted committed pages are offloaded too, and the hybrid hit rule
(kvcache/prefix_match.py) counts a host page as cached. Scratch pages are never registered, so
never offloaded. A host page stays cached after a load-back (the tier is inclusive): evicting the
loaded page again costs no second copy.

Copies, per device:

- CPU workers: a plain host tensor per group (not the memfd pools: nothing maps it), copied on the
  calling thread. An offload copies at eviction, before the page is handed out; a load-back
  copies at the end of the ``allocate_slots`` that took it, and lands there (the device page is
  registered, the host page unpinned).
- CUDA workers: pinned host memory, one stream for offloads and one for load-backs. An offload is
  queued on the offload stream after the model's stream (whatever last wrote the page), and the
  model's stream waits for it on the device before it can overwrite the page: the eviction itself
  never waits. Load-backs wait for queued offloads (one may be freeing their very device page),
  run on their own stream, and land when their event completes (``poll``): the scheduler keeps the
  request aside until then, so a request waits only for its own pages.

A host page read by a load-back in flight is pinned: it is never dropped or overwritten, so an
offload that finds every page pinned is skipped (counted). Page accounting is kvcache/host_pool.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvcache.host_pool import HostPool
from kvcache.kv_events import KVEventLog
from kvcache.spec import PoolGroupSpec


@dataclass(frozen=True)
class LoadItem:
    """One page of a load-back: host page ``host_page`` of ``group`` into device page
    ``device_page``, which is registered under ``block_hash`` when the copy landed."""

    group: str
    host_page: int
    device_page: int
    block_hash: int


@dataclass
class _Loads:
    """A request's load-backs in flight (its first ``allocate_slots``); event None: copied."""

    items: list[LoadItem] = field(default_factory=list)
    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()


class HostTier:
    def __init__(
        self,
        specs: list[PoolGroupSpec],
        host_pages: dict[str, int],
        device_buffers: dict[str, torch.Tensor],
        device: torch.device,
        events: KVEventLog,
    ) -> None:
        """``host_pages``: pages per group (kvcache/sizing.py's ``host_pages_per_group``)."""
        self.pools = {s.name: HostPool(host_pages[s.name]) for s in specs}
        self.page_size = specs[0].page_size
        self.device = device
        self._device_buffers = device_buffers
        cuda = device.type == "cuda"
        # [host_pages, Hkv, num_layers, 2, page_size, D]: a host page is one run, as on the device.
        self.buffers = {
            s.name: torch.empty(
                (host_pages[s.name], *s.buffer_shape[1:]), dtype=s.dtype, pin_memory=cuda
            )
            for s in specs
        }
        self._events = events
        self._loads: dict[str, _Loads] = {}
        self._staged: list[LoadItem] = []  # load-backs of the current allocation, not copied yet
        self._store_stream = torch.cuda.Stream(device) if cuda else None
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._stores_queued = False  # offloads queued since the model's stream last waited

    # ---- lookups ----
    def lookup(self, group: str, block_hash: int) -> int | None:
        return self.pools[group].lookup(block_hash)

    # ---- offloads (called while a device pool evicts) ----
    def offload(self, group: str, device_page: int, block_hash: int) -> None:
        """Store evicted ``device_page`` (still intact) under ``block_hash``."""
        pool = self.pools[group]
        cached = pool.lookup(block_hash)
        if cached is not None:  # loaded back earlier and still here: no second copy
            pool.touch(cached)
            return
        stored = pool.store(block_hash)
        if stored is None:
            return  # every host page is pinned by a load-back: a skipped store
        if stored.dropped_hash is not None:
            self._events.record("removed", "host", group, stored.dropped_hash)
        self._events.record("stored", "host", group, block_hash)
        src, dst = self._device_buffers[group][device_page], self.buffers[group][stored.page]
        if self._store_stream is None:
            dst.copy_(src)
            return
        if not self._stores_queued:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._stores_queued = True
        with torch.cuda.stream(self._store_stream):
            dst.copy_(src, non_blocking=True)

    # ---- load-backs ----
    def pin(self, group: str, host_page: int) -> None:
        """Pin a prefix's host page for its load-back, before the allocation that takes its device
        page evicts anything (so no offload of that allocation can drop it)."""
        self.pools[group].pin(host_page)

    def stage_load(self, item: LoadItem) -> None:
        """Copy pinned ``item.host_page`` into ``item.device_page`` at ``finish_allocation``."""
        self._staged.append(item)

    def finish_allocation(self, request_id: str) -> list[LoadItem]:
        """End of one ``allocate_slots``: make the model's stream wait for its offloads, copy its
        staged load-backs; return the load-backs that landed already (the CPU case)."""
        if self._stores_queued:
            torch.cuda.current_stream(self.device).wait_stream(self._store_stream)
            self._stores_queued = False
        staged, self._staged = self._staged, []
        if not staged:
            return []
        if self._load_stream is None:
            for item in staged:
                dst = self._device_buffers[item.group][item.device_page]
                dst.copy_(self.buffers[item.group][item.host_page])
            return self._land(_Loads(staged))
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._load_stream.wait_stream(self._store_stream)  # an offload may read its device page
        event = torch.cuda.Event()
        with torch.cuda.stream(self._load_stream):
            for item in staged:
                dst = self._device_buffers[item.group][item.device_page]
                dst.copy_(self.buffers[item.group][item.host_page], non_blocking=True)
            event.record()
        self._loads[request_id] = _Loads(staged, event)
        return []

    def loading(self, request_id: str) -> bool:
        """Whether ``request_id`` has load-backs whose copies have not finished."""
        loads = self._loads.get(request_id)
        return loads is not None and not loads.done()

    def poll(self) -> list[LoadItem]:
        """Land every load-back whose copy finished; return their pages."""
        if not self._loads:
            return []
        landed: list[LoadItem] = []
        for rid in [rid for rid, loads in self._loads.items() if loads.done()]:
            landed += self._land(self._loads.pop(rid))
        return landed

    def wait(self, request_id: str) -> list[LoadItem]:
        """Block until ``request_id``'s load-backs finished (its own only), and land them."""
        loads = self._loads.pop(request_id, None)
        if loads is None:
            return []
        if loads.event is not None:
            loads.event.synchronize()
        return self._land(loads)

    def wait_offloads(self) -> None:
        """Block until every queued offload has read its device page: before pages are handed to
        a writer outside the model's stream (a KV receive)."""
        if self._store_stream is not None:
            self._store_stream.synchronize()

    def _land(self, loads: _Loads) -> list[LoadItem]:
        for item in loads.items:
            self.pools[item.group].unpin(item.host_page)
        return loads.items

    # ---- queries ----
    def pending_loads(self) -> dict[str, list[LoadItem]]:
        """Request id -> its load-backs not landed yet."""
        return {rid: list(loads.items) for rid, loads in self._loads.items()}

    def check_integrity(self) -> None:
        if self._staged:
            raise RuntimeError(
                f"host tier: load-backs staged outside an allocation: {self._staged}"
            )
        for g, pool in self.pools.items():
            pins: Counter[int] = Counter(
                item.host_page
                for loads in self._loads.values()
                for item in loads.items
                if item.group == g
            )
            pool.check_integrity(pins, name=f"host tier of pool group {g!r}")
