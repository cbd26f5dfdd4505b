"""KVIndex: the router's view of what each worker's KV cache holds, kept from its KV events.

Per worker and pool group, the block hashes its device pool and its host tier can find (the events
of kvcache/kv_events.py applied in order, or a snapshot after a gap). A request's cached prefix on a
worker is then the run of its prompt's block hashes (chained: kvcache/block_hash.py, the same
function the workers use) that the worker holds, page by page from the first, each page counted on
the device when there, else on the host.

Hybrid models: the run is walked in the full-attention group ("full"), or in the first group the
worker reported when it has none. A sliding-window group's pages before the window are released
as requests run, so its run says little about a hit; the router's figure is an estimate either
way (the worker's own match decides).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.kv_events import MEDIA, KVEvent
from kvcache.spec import FULL_GROUP


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

    def cached_prefix(self, block_hashes: list[int]) -> CachedPrefix:
        group = FULL_GROUP if FULL_GROUP in self.groups else next(iter(self.groups), None)
        if group is None:
            return CachedPrefix()
        device = self.groups[group].get("device", set())
        host = self.groups[group].get("host", set())
        on_device = on_host = 0
        for h in block_hashes:
            if h in device:
                on_device += 1
            elif h in host:
                on_host += 1
            else:
                break
        return CachedPrefix(on_device, on_host)

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

    def cached_prefix(self, worker_id: str, block_hashes: list[int]) -> CachedPrefix:
        return self.workers[worker_id].cached_prefix(block_hashes)
