"""Transfer results and statistics: one TransferStats per finished transfer, running counters per
transceiver side. Workers put ``stats()`` of their sender or receiver into their own stats."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransferStats:
    """One transfer as one side saw it. ``latency_s``: D from ``pull()`` to the checked end, P from
    the pull request to the release of the pages. ``path``: "ucx", "host_shm" or "cuda_ipc" (None
    when the pull failed before a link chose one). ``pages``: pages moved per pool group (none when
    it failed): a sliding-window group moves only the window's pages D lacks, so it shows fewer
    than a full-attention group."""

    request_id: str
    role: str  # "send" (P) or "recv" (D)
    bytes: int
    chunks: int
    latency_s: float
    ok: bool
    error: str = ""
    path: str | None = None  # (None: failed before a path was chosen, as at connect)
    pages: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second."""
        return self.bytes / self.latency_s / 1e9 if self.latency_s > 0 else 0.0


@dataclass(frozen=True)
class TransferResult:
    """What ``KVReceiver.pull`` returns: ``ok`` only when every page landed and the declared prompt
    length equals the expected one; otherwise ``error`` says why."""

    request_id: str
    ok: bool
    error: str
    stats: TransferStats

    @property
    def status(self) -> str:
        return "ok" if self.ok else "failed"

    @property
    def bytes(self) -> int:
        return self.stats.bytes


@dataclass
class TransferCounters:
    """Running totals of one side. Changed on the transceiver's loop thread (or under the book's
    lock)."""

    transfers_ok: int = 0
    failures: int = 0
    bytes: int = 0
    chunks: int = 0
    expired_leases: int = 0
    rejected_messages: int = 0  # malformed control messages from a peer
    refused_peers: int = 0  # failed authentication, another compatibility hash, a bad address
    refused_pulls: int = 0  # P: pulls of unknown, ended or forged tickets, or of the wrong history
    reconnects: int = 0
    injected_faults: int = 0
    # UCX receives (D) or sends (P) that outlived their link's abort (paths/ucx.py): each holds a
    # staging buffer until it ends, or, into D's pages, takes the worker down
    wedged_messages: int = 0


@dataclass
class StatsBook:
    """Counters plus the last transfers (``max_stats_len``: -1 unbounded, 0 none, N the last N)."""

    max_stats_len: int = 1000
    counters: TransferCounters = field(default_factory=TransferCounters)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[TransferStats] = deque(
            maxlen=None if self.max_stats_len < 0 else self.max_stats_len
        )

    def record(self, stats: TransferStats) -> None:
        with self._lock:
            c = self.counters
            if stats.ok:
                c.transfers_ok += 1
                c.bytes += stats.bytes
            else:
                c.failures += 1
            if self.max_stats_len != 0:
                self._recent.append(stats)

    def bump(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + n)

    def drain(self) -> list[TransferStats]:
        """The transfers recorded since the last drain (oldest first)."""
        with self._lock:
            out = list(self._recent)
            self._recent.clear()
            return out

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = asdict(self.counters)
            last = self._recent[-1] if self._recent else None
        if last is not None:
            snap["last_transfer"] = {**asdict(last), "gbps": last.gbps}
        return snap
