"""RecentIds: the request ids a worker saw lately, in a bounded set.

A worker remembers which requests' calls arrived and which its caller gave up on before they
did (the router's cancel or abort can overtake the call it is about: Ray does not order an async
actor's calls). Forgetting the oldest is safe: far more ids are kept than a worker has in flight.
"""

from __future__ import annotations

import collections

REMEMBERED = 10_000  # ids kept per set


class RecentIds:
    def __init__(self, limit: int = REMEMBERED) -> None:
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._limit = limit

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        self._ids.move_to_end(rid)
        if len(self._ids) > self._limit:
            self._ids.popitem(last=False)

    def discard(self, rid: str) -> None:
        self._ids.pop(rid, None)

    def __contains__(self, rid: object) -> bool:
        return rid in self._ids
