"""DoneBoard: the decode side's finished direct reads in host shared memory, so that the prefill
worker learns of them without a message (the mirror of P's lease board, lease_board.py).

A direct read that succeeded ends with one record here: the lease's board slot and generation,
the bytes read, the pull's time and its data path. D makes one board per direct link and names it
in Hello; P maps it read-only, says in HelloReply that it did, and polls it while it holds leases
(transfer/sender.py), releasing each lease whose record it finds. Writing a record is a few stores
on the caller's thread: no wake-up of D's event loop, which would take the GIL from the next pull
(docs/benchmarks/transfer.md), and no message. Failed reads still send ReadDone, whose error text
P logs; so does a link whose P could not open the board.

The board is a ring of records and a count of records ever written, stored after the record
(D writes under a lock; P reads the count, the records, then the count again, and drops, counted
as lost, any record D may have been overwriting meanwhile). A record P never sees only delays
that lease until it expires. Generations name one lease for good, so a stale record releases
nothing. Closing the board sets a flag after the last record: P then drains it once more and stops
polling it (a link that fell back to UCX closes its board in the handshake, and P would otherwise
poll it every millisecond for the life of the link). Memory order is lease_board.py's: stores
become visible in order (x86-64).
"""

from __future__ import annotations

import threading

import numpy as np

from transfer.shared_file import SharedFile, SharedFileUnavailable, map_readonly

_MAGIC = b"DUETDB01"
_HEADER = 32  # magic, capacity (uint64), records ever written (uint64), flags (uint64)
_ENDED = 1  # flag: D closed the board (it posts no more; P may stop reading it)
RECORD = np.dtype(
    [("gen", "<u8"), ("slot", "<i8"), ("nbytes", "<i8"), ("micros", "<i8"), ("path", "<i8")]
)
_PREFIX = "duet-done-"
CAPACITY = 4096  # records: P reads every few ms, so it can only fall behind by that many reads
PATHS = ("local", "cuda_ipc", "host_shm")  # the data paths, by their code in a record

DoneBoardUnavailable = SharedFileUnavailable


class DoneBoard:
    """D's side: makes the board and writes it. Thread-safe (pulls end on their callers' threads);
    ``post`` after ``close`` does nothing."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a done board needs at least one record")
        self._file = SharedFile(_PREFIX, _HEADER + capacity * RECORD.itemsize)
        self.path = self._file.path
        m = self._file.map
        m[:16] = _MAGIC + capacity.to_bytes(8, "little")
        self._count = np.frombuffer(m, dtype="<u8", count=1, offset=16)
        self._flags = np.frombuffer(m, dtype="<u8", count=1, offset=24)
        self._records = np.frombuffer(m, dtype=RECORD, count=capacity, offset=_HEADER)
        self._written = 0
        self._lock = threading.Lock()
        self._closed = False

    def post(self, slot: int, gen: int, nbytes: int, micros: int, path: str) -> None:
        """Record that the lease ``gen`` in P's board slot ``slot`` was read (``nbytes`` bytes in
        ``micros`` us, over ``path``); P may release its pages."""
        code = PATHS.index(path)
        with self._lock:
            if self._closed:
                return
            self._records[self._written % len(self._records)] = (gen, slot, nbytes, micros, code)
            self._written += 1
            self._count[0] = self._written  # last: the record is complete before it counts

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # After every record (posts take the lock): a link that fell back to UCX, or ended,
            # tells P to stop polling a board nobody writes.
            self._flags[0] = _ENDED
            del self._count, self._flags, self._records
            self._file.close()


class DoneBoardView:
    """P's side: one decode worker's board, mapped read-only; ``drain`` returns the records
    written since the last call, as (slot, gen, nbytes, micros, path), and how many were lost."""

    def __init__(self, path: str) -> None:
        self._map = map_readonly(path, _PREFIX, "done board")
        size = len(self._map)
        capacity = int.from_bytes(self._map[8:16], "little") if size >= _HEADER else 0
        if (
            self._map[:8] != _MAGIC
            or capacity < 1  # (an empty ring would report a lost record at every poll)
            or size != _HEADER + capacity * RECORD.itemsize
        ):
            self._map.close()
            raise DoneBoardUnavailable(f"{path} is not a done board of this version")
        self._count = np.frombuffer(self._map, dtype="<u8", count=1, offset=16)
        self._flags = np.frombuffer(self._map, dtype="<u8", count=1, offset=24)
        self._records = np.frombuffer(self._map, dtype=RECORD, count=capacity, offset=_HEADER)
        self._seen = int(self._count[0])

    @property
    def ended(self) -> bool:
        """D closed the board: once a drain after this returned True, nothing more will come."""
        return bool(int(self._flags[0]) & _ENDED)

    def drain(self) -> tuple[list[tuple[int, int, int, int, str]], int]:
        cap = len(self._records)
        count = int(self._count[0])
        first = max(self._seen, count - cap)
        lost = first - self._seen
        got = self._records[np.arange(first, count) % cap].copy() if count > first else None
        # Not trusted: records D may have overwritten while we copied them, including the one it
        # may be writing now (record n is written into n - cap's place before the count says n + 1).
        valid_from = max(first, int(self._count[0]) - cap + 1)
        lost += valid_from - first
        self._seen = count
        if got is None:
            return [], lost
        out = []
        for gen, slot, nbytes, micros, code in got[valid_from - first :].tolist():
            path = PATHS[code] if 0 <= code < len(PATHS) else "unknown"
            out.append((slot, gen, nbytes, micros, path))
        return out, lost

    def close(self) -> None:
        del self._count, self._flags, self._records
        try:
            self._map.close()
        except BufferError:
            pass
