"""LeaseTable: the prefill side's pinned requests, and the one place their pages are given back.

A published request holds its pages under a lease until D acks (TransferAck, or the end of a
direct read: read_ends.py), the lease expires, or its transfer fails. ``release`` calls the owner's
callback exactly once per publish, with the lease (it is where the lease leaves P's lease board
and the worker frees the pages). A lease that is SERVING (a UCX pull is reading its pages) never
expires: the serving transfer renews it per chunk and, should it fail, releases it only after its
UCX sends have ended. A direct read never makes a lease SERVING: D checks the board after its copy
instead.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class LeaseState(str, enum.Enum):
    PUBLISHED = "published"  # waiting for D's pull
    SERVING = "serving"  # a pull is reading the pages
    AWAITING_ACK = "awaiting_ack"  # TransferDone sent


@dataclass
class Lease:
    request_id: str
    page_ids: dict[str, list[int]]
    declared_prompt_len: int
    expires_at: float  # clock() time
    slot: int = -1  # on the lease board (lease_board.py); -1: none
    gen: int = 0  # the slot's generation for this lease
    state: LeaseState = LeaseState.PUBLISHED
    cancel_requested: bool = False


class LeaseTable:
    """Thread-safe. ``release_cb`` runs outside the lock, on the thread that released."""

    def __init__(
        self,
        release_cb: Callable[[Lease], None],
        clock: Callable[[], float] = time.monotonic,
        history: int = 10_000,
    ) -> None:
        self._release_cb = release_cb
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._by_slot: dict[int, Lease] = {}  # the live leases with a lease board slot
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> how its lease ended
        self._history = history

    def publish(
        self,
        request_id: str,
        page_ids: dict[str, list[int]],
        declared_prompt_len: int,
        lease_s: float,
        slot: int = -1,
        gen: int = 0,
    ) -> Lease:
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} is already published")
            self._ended.pop(request_id, None)
            lease = Lease(
                request_id, page_ids, declared_prompt_len, self._clock() + lease_s, slot, gen
            )
            self._leases[request_id] = lease
            if slot >= 0:
                self._by_slot[slot] = lease
            return lease

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    def by_slot(self, slot: int) -> Lease | None:
        """The live lease in lease board slot ``slot``, if any."""
        with self._lock:
            return self._by_slot.get(slot)

    def why_missing(self, request_id: str) -> tuple[str, str]:
        """(code, reason) for a request that has no lease: expired, released, or unknown."""
        with self._lock:
            ended = self._ended.get(request_id)
        if ended is None:
            return "unknown", f"request {request_id!r} was never published here"
        if ended.startswith("expired"):
            return "expired", f"the lease of request {request_id!r} {ended}"
        return "unknown", f"request {request_id!r} was already released ({ended})"

    def begin_serving(self, request_id: str, expected: Lease | None = None) -> Lease:
        """Move a PUBLISHED lease to SERVING. Raises KeyError (no lease) or ValueError (busy, or
        not ``expected``: the request was released and published again meanwhile)."""
        with self._lock:
            lease = self._leases[request_id]
            if expected is not None and lease is not expected:
                raise ValueError(f"request {request_id!r} was published again meanwhile")
            if lease.state is not LeaseState.PUBLISHED:
                raise ValueError(
                    f"request {request_id!r} is {lease.state.value}, not waiting for a pull"
                )
            lease.state = LeaseState.SERVING
            return lease

    def renew(self, request_id: str, lease_s: float) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.expires_at = max(lease.expires_at, self._clock() + lease_s)

    def await_ack(self, request_id: str, ack_deadline_s: float) -> bool:
        """The serving pull sent everything: the lease now ends on the ack or ``ack_deadline_s``
        from now. False (and nothing changes) when a cancel came while it was SERVING: the caller
        releases it now. (Under the lock: a cancel after this finds it AWAITING_ACK, and ends it.)"""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return True
            if lease.cancel_requested:
                return False
            lease.state = LeaseState.AWAITING_ACK
            lease.expires_at = self._clock() + ack_deadline_s
            return True

    def release(self, request_id: str, how: str, force: bool = False) -> bool:
        """End the lease and call the release callback; False if it had ended already, or if it is
        SERVING and ``force`` is not set (only the serving transfer may end a SERVING lease)."""
        return self._end(
            request_id, how, lambda lease: force or lease.state is not LeaseState.SERVING
        )

    def end_on_ack(self, request_id: str, gen: int, ok: bool, how: str) -> bool:
        """An ack from outside the serving pull (most come after it ended): it ends only the lease
        of generation ``gen`` (never a later publish of the request), a positive one only while
        that lease awaits its ack, a negative one also before any pull had it (D gave up before
        asking). A lease a pull is serving ends with that pull. False if nothing ended."""

        def may_end(lease: Lease) -> bool:
            if lease.gen != gen:
                return False
            return lease.state is LeaseState.AWAITING_ACK or (
                not ok and lease.state is LeaseState.PUBLISHED
            )

        return self._end(request_id, how, may_end)

    def end_direct(self, request_id: str, gen: int, how: str) -> bool:
        """The end of a direct read of lease ``gen`` (ReadDone, or a done-board record): it ends
        that lease only, never a later publish of the request. False if nothing ended."""
        return self._end(
            request_id,
            how,
            lambda lease: (
                lease.gen == gen and lease.slot >= 0 and lease.state is not LeaseState.SERVING
            ),
        )

    def _end(self, request_id: str, how: str, may_end: Callable[[Lease], bool]) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not may_end(lease):
                return False
            del self._leases[request_id]
            if self._by_slot.get(lease.slot) is lease:
                del self._by_slot[lease.slot]
            self._ended[request_id] = how
            while len(self._ended) > self._history:
                self._ended.popitem(last=False)
        log.debug("lease of %s ended: %s", request_id, how)
        try:
            self._release_cb(lease)
        except Exception:
            log.exception("release callback failed for %s", request_id)
        return True

    def cancel(self, request_id: str) -> bool:
        """Give the pages back now unless a pull is reading them (then the pull's end does)."""

        def may_end(lease: Lease) -> bool:  # (under the lock: no pull can start in between)
            if lease.state is LeaseState.SERVING:
                lease.cancel_requested = True
                return False
            return True

        return self._end(request_id, "cancelled", may_end)

    def expire_due(self) -> list[str]:
        """Release every lease past its expiry that no pull is reading; returns their ids."""
        now = self._clock()
        with self._lock:
            due = [
                lease
                for lease in self._leases.values()
                if lease.expires_at <= now and lease.state is not LeaseState.SERVING
            ]
        expired = []
        for lease in due:
            how = (
                "expired before a pull"
                if lease.state is LeaseState.PUBLISHED
                else "expired waiting for the ack"
            )
            # That very lease, if still due: it may have been served, acked, or ended and
            # published again since the list was made.
            if self._end(lease.request_id, how, functools.partial(_still_due, lease, now)):
                expired.append(lease.request_id)
        return expired

    def release_all(self, how: str) -> None:
        """Shutdown: give every page back (callers first end all transfers)."""
        with self._lock:
            ids = list(self._leases)
        for rid in ids:
            self.release(rid, how, force=True)


def _still_due(due: Lease, now: float, lease: Lease) -> bool:
    return lease is due and lease.state is not LeaseState.SERVING and lease.expires_at <= now
