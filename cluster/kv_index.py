"""KVIndex: the router's view of what each worker's KV cache holds, kept from its KV events.

Per worker and pool group, the block hashes its device pool and its host tier can find (the events
of kvcache/kv_events.py applied in order, or a snapshot after a gap). A request's cached prefix on a
worker is then the hit the worker's own lookup (kvcache/prefix_match.py) would find from those
blocks: its prompt's block hashes (chained: kvcache/block_hash.py, the same function the workers
use) that every full-attention group holds from the first page, shortened until each sliding-window
group holds the pages its window reads before the hit (a decode worker holds only the last window
of a prompt it received: the full group alone would promise a hit it cannot take). A page counts on
the device when every group that needs it holds it there, else on the host. The router's figure is
an estimate (events lag; the worker's own match decides).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.kv_events import MEDIA, KVEvent
from kvcache.sliding_window import hybrid_hit_pages, pages_before_hit
from kvcache.spec import group_window


@dataclass(frozen=True)
class CachedPrefix:
    """How many leading pages of a prompt a worker holds, by tier."""

    device_pages: int = 0
    host_pages: int = 0

    @property
    def num_pages(self) -> int:
        return self.device_pages + self.host_pages


@dataclass
class WorkerBlocks:
    """One worker's findable blocks: group -> medium -> block hashes."""

    groups: dict[str, dict[str, set[int]]] = field(default_factory=dict)

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            blocks = self._blocks(event.group, event.medium)
            if event.kind == "stored":
                blocks.update(event.block_hashes)
            else:
                blocks.difference_update(event.block_hashes)

    def replace(self, blocks: dict[str, dict[str, list[int]]]) -> None:
        self.groups = {
            g: {medium: set(hashes) for medium, hashes in by_medium.items()}
            for g, by_medium in blocks.items()
        }

    def cached_prefix(self, block_hashes: list[int], page_size: int) -> CachedPrefix:
        if not self.groups:
            return CachedPrefix()
        empty: set[int] = set()
        device = {g: media.get("device", empty) for g, media in self.groups.items()}
        host = {g: media.get("host", empty) for g, media in self.groups.items()}

        def held(g: str, i: int) -> bool:
            return block_hashes[i] in device[g] or block_hashes[i] in host[g]

        windows = {g: group_window(g) for g in self.groups}
        full = [g for g, w in windows.items() if w is None]
        k = 0  # (with no full group, every page: the window groups shorten it)
        while k < len(block_hashes) and all(held(g, k) for g in full):
            k += 1
        needed = {g: pages_before_hit(w, page_size) for g, w in windows.items() if w is not None}
        k = hybrid_hit_pages(k, needed, held)
        on_device = sum(
            all(
                block_hashes[i] in device[g]
                for g in self.groups
                if g not in needed or i >= k - needed[g]
            )
            for i in range(k)
        )
        return CachedPrefix(on_device, k - on_device)

    def _blocks(self, group: str, medium: str) -> set[int]:
        if medium not in MEDIA:
            raise ValueError(f"unknown KV event medium {medium!r}; expected one of {MEDIA}")
        return self.groups.setdefault(group, {}).setdefault(medium, set())


class KVIndex:
    """Every worker's WorkerBlocks, by worker id, with the feed's bookkeeping per worker."""

    def __init__(self, worker_ids: list[str]) -> None:
        self.workers = {w: WorkerBlocks() for w in worker_ids}
        self.rebuilds = dict.fromkeys(worker_ids, 0)  # snapshots taken (first contact included)
        self.batches = dict.fromkeys(worker_ids, 0)  # event batches applied

    def apply(self, worker_id: str, events: list[KVEvent]) -> None:
        self.workers[worker_id].apply(events)
        self.batches[worker_id] += 1

    def rebuild(self, worker_id: str, blocks: dict[str, dict[str, list[int]]]) -> None:
        self.workers[worker_id].replace(blocks)
        self.rebuilds[worker_id] += 1

    def forget(self, worker_id: str) -> None:
        """The worker is gone (or restarting): assume it holds nothing until its next snapshot."""
        self.workers[worker_id] = WorkerBlocks()

    def cached_prefix(
        self, worker_id: str, block_hashes: list[int], page_size: int
    ) -> CachedPrefix:
        return self.workers[worker_id].cached_prefix(block_hashes, page_size)
