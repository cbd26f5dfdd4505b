"""The transfer records and counters of a tensor-parallel worker, over all its ranks.

A request between tensor-parallel workers moves in parts, one per (decode rank, prefill rank)
pair (worker_common/tp_transfer.py), each with a TransferStats of its own on the rank that served
or pulled it, under the sub-id ``<request id>|d<decode rank>``. Rank 0 joins them into one record
under the request's id, the record /transfer_stats shows and the counters count:

- ``bytes`` and ``chunks``: summed over the parts (every rank's bytes);
- ``latency_s``: the slowest part's (the parts run at once);
- ``ok``: every part ok; ``error``: each failed part's, naming its ranks;
- ``pages``: per pool group, the most any part moved. Every part moves a head slice of the same
  pages, so this is the request's page count, as a tp 1 transfer shows it (not pages x parts).

Counters: ``transfers_ok``, ``failures``, ``bytes`` and ``chunks`` count the joined records (one
per request); the others (expired leases, refused peers and pulls, injected faults, reconnects,
rejected messages) are summed over the ranks' own transceivers. Rank 0's are read when asked;
those of ranks 1.. are the answer to the previous ask (``refresh``, which never waits on a rank),
so they trail by one stats interval.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transfer.stats import StatsBook, TransferCounters, TransferStats

# Counted per joined record here, not summed from the ranks' per-part counters.
JOINED = ("transfers_ok", "failures", "bytes", "chunks")


def join_parts(
    request_id: str, role: str, parts: Sequence[tuple[str, TransferStats]]
) -> TransferStats:
    """One record of ``request_id`` from its parts' records, each with its part's name (its
    ranks, for the errors)."""
    errors = [f"{part}: {s.error}" for part, s in parts if not s.ok]
    pages: dict[str, int] = {}
    for _, s in parts:
        for group, n in s.pages.items():
            pages[group] = max(pages.get(group, 0), n)
    ok = bool(parts) and not errors
    return TransferStats(
        request_id,
        role,
        sum(s.bytes for _, s in parts),
        sum(s.chunks for _, s in parts),
        max((s.latency_s for _, s in parts), default=0.0),
        ok,
        "; ".join(errors),
        parts[-1][1].path if parts else None,
        pages if ok else {},
    )


def counters_of(snapshot: Mapping[str, Any]) -> TransferCounters:
    """The TransferCounters in a transceiver's ``stats()``."""
    names = {f.name for f in dataclasses.fields(TransferCounters)}
    return TransferCounters(**{k: int(v) for k, v in snapshot.items() if k in names})


class TPTransferBook:
    """Rank 0's book of the joined records, and the ranks' counters. Thread-safe."""

    def __init__(self, max_stats_len: int, num_other_ranks: int) -> None:
        self.book = StatsBook(max_stats_len)
        self._lock = threading.Lock()
        self._ranks = [TransferCounters() for _ in range(num_other_ranks)]

    def record(self, stats: TransferStats) -> None:
        """A request's joined record (join_parts)."""
        self.book.record(stats)
        self.book.bump("chunks", stats.chunks)

    def drain(self) -> list[TransferStats]:
        return self.book.drain()

    def take_rank_counters(self, rank: int, counters: TransferCounters) -> None:
        """The counters rank ``rank`` (1..) answered with."""
        with self._lock:
            self._ranks[rank - 1] = counters

    def refresh(self, ask: Callable[[int], Any]) -> None:
        """Ask every rank 1.. for its counters again without waiting: ``ask(rank)`` returns the
        ObjectRef of that rank's TransferCounters; each answer lands when it comes (a rank that
        does not answer keeps its last counters; losing it takes the worker down elsewhere)."""
        for rank in range(1, len(self._ranks) + 1):
            ref = ask(rank)
            ref.future().add_done_callback(lambda f, rank=rank: self._landed(rank, f))

    def _landed(self, rank: int, future: Any) -> None:
        if future.exception() is None:
            self.take_rank_counters(rank, future.result())

    def stats(self, own: Mapping[str, Any]) -> dict[str, Any]:
        """Rank 0's transceiver ``stats()`` ``own`` with every counter over all ranks, and the
        last joined record as ``last_transfer``."""
        with self._lock:
            ranks = list(self._ranks)
        joined = self.book.snapshot()
        out: dict[str, Any] = {k: v for k, v in own.items() if k != "last_transfer"}
        for field in dataclasses.fields(TransferCounters):
            name = field.name
            if name in JOINED:
                out[name] = joined[name]
            else:
                out[name] = int(own.get(name, 0)) + sum(getattr(c, name) for c in ranks)
        if "last_transfer" in joined:
            out["last_transfer"] = joined["last_transfer"]
        return out
