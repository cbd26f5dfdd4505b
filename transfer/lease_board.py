"""LeaseBoard: the prefill side's leases in host shared memory, so that a decode worker of the same
host can check one without asking (the direct read path, direct_read.py).

One fixed-size slot per live lease: a word ``generation << 1 | live``, the declared prompt length,
and a digest of the request id and its page ids. P alone writes the board; D only maps it read-only
and reads a slot twice: before its copy (is the lease live, does it name exactly the ticket's pages,
what prompt length does P declare) and after it (is it still the same lease). P retires a slot (new
generation, not live) *before* it gives the pages back, and publishes the word last, so a read that
finds the same live word on both sides of its copy read pages that nobody could have reused in
between. A lease that ends during a copy fails that pull; nothing is ever locked, so a dead peer
cannot wedge the other.

Generations come from one counter per board, so a generation names one lease for good (a late
ReadDone cannot release a later lease of the same request, even in the same slot). The file's
making, mapping and clean-up after killed workers are transfer/shared_file.py's.

Memory order: P writes the fields, then the word, under a lock; D reads the word, the fields, and
the word again (a torn read counts as "not live"), and its post-copy check reads the word after the
copy has ended (its CUDA event, or the copy call's return). That relies on x86-64's ordering
(TSO): stores become visible in order, and D's read of the word is not moved before the copy's
reads of the pages. A weakly ordered host (aarch64) would need a fence on both sides, which this
Python code does not issue: there a torn read only fails a pull, but the post-copy check is not
proven to catch a page reused while the copy read it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from transfer.shared_file import SharedFile, SharedFileUnavailable, map_readonly

_MAGIC = b"DUETLB01"
_HEADER = 16  # magic, then the slot count (uint64)
SLOT = np.dtype([("word", "<u8"), ("declared", "<i8"), ("digest", "V16")])  # 32 bytes
_PREFIX = "duet-leases-"


BoardUnavailable = SharedFileUnavailable  # the board cannot be made or opened here


def lease_digest(request_id: str, page_ids: Mapping[str, Sequence[int]]) -> bytes:
    """16 bytes that bind a lease to its request and its exact page ids, pool by pool."""
    return digest_of(
        request_id,
        ((name, np.asarray(page_ids[name], dtype=np.int64)) for name in sorted(page_ids)),
    )


def digest_of(request_id: str, pools: Iterable[tuple[str, np.ndarray]]) -> bytes:
    """``lease_digest`` from each pool's ids as a C-contiguous int64 array, pools in name order
    (hashed in place: the direct read's quick checks pass views of its slot)."""
    h = hashlib.blake2b(request_id.encode(), digest_size=16)
    for name, ids in pools:
        h.update(b"\0" + name.encode() + b"\0")
        h.update(ids)
    return h.digest()


class LeaseBoard:
    """P's side: makes the board and writes it. Thread-safe: publish runs on the worker's thread,
    retire on whichever thread ends the lease, close at shutdown."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a lease board needs at least one slot")
        self._file = SharedFile(_PREFIX, _HEADER + num_slots * SLOT.itemsize)
        self.path = self._file.path
        self._map = self._file.map
        self._map[:_HEADER] = _MAGIC + num_slots.to_bytes(8, "little")
        self.slots = np.frombuffer(self._map, dtype=SLOT, count=num_slots, offset=_HEADER)
        self._words, self._declared, self._digests = (self.slots[f] for f in SLOT.names)
        self._generation = 0  # the last one handed out, on this whole board
        self._free = list(range(num_slots - 1, -1, -1))
        self._live: dict[int, int] = {}  # slot -> generation of its live lease
        self._lock = threading.Lock()
        self._closed = False

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def fresh_generation(self) -> int:
        """A generation no lease of this board has had or will have (for a lease without a slot)."""
        with self._lock:
            return self._next_generation()

    def publish(self, declared_prompt_len: int, digest: bytes) -> tuple[int, int] | None:
        """Make a lease visible; returns its (slot, generation), or None when every slot is in
        use (that lease is then pulled over UCX only)."""
        with self._lock:
            if self._closed or not self._free:
                return None
            slot = self._free[-1]
            # The fields first (a length that does not fit raises here, with the slot still
            # free), the word last: the slot is complete before it is live.
            self._declared[slot] = declared_prompt_len
            self._digests[slot] = digest
            self._free.pop()
            gen = self._next_generation()
            self._live[slot] = gen
            self._words[slot] = (gen << 1) | 1
            return slot, gen

    def retire(self, slot: int, gen: int) -> None:
        """End the visibility of lease ``gen`` in ``slot``: call before its pages are given back.
        A stale call (that lease already retired) and a call after close do nothing."""
        with self._lock:
            if self._closed or self._live.get(slot) != gen:
                return
            del self._live[slot]
            self._words[slot] = self._next_generation() << 1  # no ticket carries it; one store
            self._free.append(slot)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # D may still map the file: no lease may stay live there once retire() does nothing
            # (a lease ending after this gives its pages back all the same).
            for slot in self._live:
                self._words[slot] = self._next_generation() << 1
            self._live.clear()
            del self.slots, self._words, self._declared, self._digests
            self._file.close()


class LeaseBoardView:
    """D's side: one peer's board, mapped read-only."""

    def __init__(self, path: str) -> None:
        self._map = map_readonly(path, _PREFIX, "lease board")
        size = len(self._map)
        if size < _HEADER:
            self._map.close()
            raise BoardUnavailable(f"the lease board {path} is truncated")
        magic, count = self._map[:8], int.from_bytes(self._map[8:_HEADER], "little")
        if magic != _MAGIC or size != _HEADER + count * SLOT.itemsize:
            self._map.close()
            raise BoardUnavailable(f"{path} is not a lease board of this version")
        slots = np.frombuffer(self._map, dtype=SLOT, count=count, offset=_HEADER)
        self._words, self._declared, self._digests = (slots[f] for f in SLOT.names)

    def word(self, slot: int) -> int:
        return int(self._words[slot]) if 0 <= slot < len(self._words) else 0

    def entry(self, slot: int) -> tuple[int, int, bytes]:
        """(word, declared prompt length, digest); the word first, as P wrote it last."""
        word = self.word(slot)
        if not word & 1:
            return word, 0, b""
        declared, digest = int(self._declared[slot]), bytes(self._digests[slot])
        if self.word(slot) != word:  # retired (and maybe reused) while we read: not this lease
            return 0, 0, b""
        return word, declared, digest

    def close(self) -> None:
        del self._words, self._declared, self._digests
        try:
            self._map.close()
        except BufferError:
            pass
