"""Transfer results and statistics: one TransferStats per finished transfer, running counters per
transceiver side. Workers put ``stats()`` of their sender/receiver into their own stats."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransferStats:
    """One transfer as one side saw it. ``latency_s``: D from pull() to the checked TransferDone,
    P from the PullRequest to TransferDone sent."""

    request_id: str
    role: str  # "send" (P) or "recv" (D)
    bytes: int
    chunks: int
    latency_s: float
    ok: bool
    error: str = ""
    path: str = "ucx"  # the link's data path: "ucx", "cuda_ipc", "host_shm" or "local" (ipc.py)

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second."""
        return self.bytes / self.latency_s / 1e9 if self.latency_s > 0 else 0.0


@dataclass(frozen=True)
class TransferResult:
    """What ``KVReceiver.pull`` returns. ``ok`` only when every chunk arrived and P's declared
    prompt length equals the expected one; otherwise ``error`` says why."""

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
    """Running totals of one side (sender or receiver). Updated on the loop thread, or under the
    book's lock (``StatsBook.record``) from other threads."""

    transfers_ok: int = 0
    failures: int = 0
    bytes: int = 0
    chunks: int = 0
    expired_leases: int = 0
    rejected_messages: int = 0
    refused_peers: int = 0
    reconnects: int = 0
    prestaged_chunks: int = 0  # P: first chunks sent as gathered at publish (prestage.py)
    late_copies: int = 0  # D: direct copies still running when their pull ended (fenced)
    late_copy_waits: int = 0  # D: UCX pulls into pool memory that first waited for one


@dataclass
class StatsBook:
    """Counters plus the last transfers (``max_stats_len``: -1 unbounded, 0 none kept, N the last N)."""

    max_stats_len: int = 1000
    counters: TransferCounters = field(default_factory=TransferCounters)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[TransferStats] = deque(
            maxlen=None if self.max_stats_len < 0 else self.max_stats_len
        )

    def record(self, stats: TransferStats, chunks: int = 0) -> None:
        """One finished transfer; ``chunks`` are added to the chunk counter under the same lock
        (for transfers that end off the loop thread, such as direct reads)."""
        with self._lock:
            c = self.counters
            c.chunks += chunks
            if stats.ok:
                c.transfers_ok += 1
                c.bytes += stats.bytes
            else:
                c.failures += 1
            if self.max_stats_len != 0:
                self._recent.append(stats)

    def bump(self, counter: str) -> None:
        """Add one to ``counter``, from any thread."""
        with self._lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)

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
