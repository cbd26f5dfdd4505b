"""KV events: which blocks a KV cache manager stored or removed, on which tier, by block hash.

A worker drains them after each engine step and publishes them to the router in numbered batches
(worker_common/kv_events.py), where they keep a per-worker prefix index (cluster/kv_index.py), as
vLLM's and Dynamo's KV events do. Events say what is findable by ``match_prefix``:

- ``stored`` / medium ``device``: a page was registered in a device pool's prefix index;
- ``removed`` / ``device``: an evictable page lost its hash to an allocation (it may have gone to
  the host tier: a ``stored`` / ``host`` event follows then);
- ``stored`` / ``host``: an evicted page was copied into the host tier;
- ``removed`` / ``host``: the host tier dropped a page to make room.

A page that is held or evictable stays findable, so freeing a request publishes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["stored", "removed"]
Medium = Literal["device", "host"]
MEDIA: tuple[Medium, ...] = ("device", "host")


@dataclass
class KVEvent:
    """Blocks of one pool group that changed the same way on the same tier, in order."""

    kind: Kind
    medium: Medium
    group: str
    block_hashes: list[int] = field(default_factory=list)


class KVEventLog:
    """Events recorded since the last drain; consecutive events of one kind, medium and group are
    merged into one. Disabled (records nothing) unless a worker publishes events."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []

    def record(self, kind: Kind, medium: Medium, group: str, block_hash: int) -> None:
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        if last is not None and (last.kind, last.medium, last.group) == (kind, medium, group):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(KVEvent(kind, medium, group, [block_hash]))

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
