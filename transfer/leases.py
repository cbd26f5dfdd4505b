"""LeaseTable: the prefill side's published requests, and the one place their pages are given back.

A published request's pages are pinned under a lease until one of: the pull that serves it ends
(after D's final notice, or its failure), the lease expires unpulled, D gives the ticket up before
asking, the request is cancelled, or the sender closes. ``_end`` is the only way out: it calls the
owner's release callback exactly once per publish. A lease that a pull is serving (SERVING, over
UCX or a direct read) never expires: only that pull ends it, so P's pages cannot be reused under a
copy that still reads them.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENDED_KEPT = 10_000  # how leases ended, for the answers to late pulls


class LeaseState(enum.Enum):
    PUBLISHED = "published"  # waiting for D's pull
    SERVING = "serving"  # a pull holds it


@dataclass
class Lease:
    request_id: str
    gen: int
    page_ids: dict[str, list[int]]
    declared_prompt_len: int
    expires_at: float  # clock() time
    state: LeaseState = LeaseState.PUBLISHED
    # (first, count): the KV heads of each page this lease's one reader may pull (a decode rank of
    # another tensor-parallel size, transfer/tp_mapper.py); None: whole pages.
    heads: tuple[int, int] | None = None


class LeaseTable:
    """Thread-safe. ``release_cb`` runs outside the lock, on the thread that ended the lease."""

    def __init__(
        self, release_cb: Callable[[Lease], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._release_cb = release_cb
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> how its lease ended
        self._generations = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def publish(
        self,
        request_id: str,
        page_ids: dict[str, list[int]],
        declared_prompt_len: int,
        lease_s: float,
        heads: tuple[int, int] | None = None,
    ) -> Lease:
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} is already published")
            self._ended.pop(request_id, None)
            lease = Lease(
                request_id,
                next(self._generations),
                page_ids,
                declared_prompt_len,
                self._clock() + lease_s,
                heads=heads,
            )
            self._leases[request_id] = lease
            return lease

    def get(self, request_id: str) -> Lease | None:
        """The request's live lease, if any."""
        with self._lock:
            return self._leases.get(request_id)

    def find(self, request_id: str, gen: int) -> Lease | tuple[str, str]:
        """The lease of generation ``gen`` a pull may take, or (code, reason) why there is none."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                ended = self._ended.get(request_id)
                if ended is None:
                    return "unknown", f"request {request_id!r} was never published here"
                code = "expired" if ended.startswith("expired") else "unknown"
                return code, f"the lease of request {request_id!r} ended ({ended})"
            if lease.gen != gen:
                return "unknown", (
                    f"the ticket's lease of {request_id!r} (generation {gen}) ended; the request "
                    f"was published again since (generation {lease.gen})"
                )
            if lease.state is LeaseState.SERVING:
                return "busy", f"request {request_id!r} is already being pulled"
            return lease

    def begin(self, lease: Lease) -> bool:
        """A pull holds ``lease`` from now on (it cannot expire); False if it ended meanwhile or
        another pull holds it."""
        with self._lock:
            if self._leases.get(lease.request_id) is not lease or lease.state is LeaseState.SERVING:
                return False
            lease.state = LeaseState.SERVING
            return True

    def end(self, lease: Lease, how: str) -> bool:
        """The serving pull is done with ``lease``: give its pages back."""
        return self._end(lease.request_id, how, lambda current: current is lease)

    def end_unpulled(self, request_id: str, gen: int, how: str) -> bool:
        """D gave up the ticket of lease ``gen`` before pulling it: end that lease if no pull
        has it (never a later publish of the request)."""
        return self._end(
            request_id,
            how,
            lambda lease: lease.gen == gen and lease.state is LeaseState.PUBLISHED,
        )

    def cancel(self, request_id: str, gen: int | None = None) -> bool:
        """Give the pages back now, unless a pull holds them (then that pull ends the lease: False);
        with ``gen``, only if the request's lease is still that one."""

        def may_end(lease: Lease) -> bool:  # under the lock: no pull can begin in between
            return lease.state is not LeaseState.SERVING and gen in (None, lease.gen)

        return self._end(request_id, "cancelled", may_end)

    def expire_due(self) -> int:
        """End every unpulled lease past its expiry; returns how many."""
        now = self._clock()
        with self._lock:
            due = [
                lease
                for lease in self._leases.values()
                if lease.expires_at <= now and lease.state is LeaseState.PUBLISHED
            ]
        return sum(
            self._end(
                lease.request_id,
                "expired before a pull",
                lambda current, due=lease: current is due and current.state is LeaseState.PUBLISHED,
            )
            for lease in due
        )

    def release_all(self, how: str) -> None:
        """Shutdown: give every page back (the caller first ended every pull)."""
        with self._lock:
            ids = list(self._leases)
        for rid in ids:
            self._end(rid, how, lambda _lease: True)

    def _end(self, request_id: str, how: str, may_end: Callable[[Lease], bool]) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not may_end(lease):
                return False
            del self._leases[request_id]
            self._ended[request_id] = how
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        log.debug("lease of %s ended: %s", request_id, how)
        try:
            self._release_cb(lease)
        except Exception:
            log.exception("release callback failed for %s", request_id)
        return True
