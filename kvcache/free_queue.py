"""The free queue: pages that no request holds, in eviction order (head = evicted first).

A doubly linked list threaded through two arrays indexed by page id, so that removing an arbitrary
page (a cached page hit by a prefix match) is O(1), as are pushing to either end and popping the head.
"""

from __future__ import annotations

from collections.abc import Iterator


class FreeQueue:
    """Doubly linked list of page ids in ``[0, capacity)``; each page is in the queue at most once.

    Slot ``capacity`` of the arrays is the sentinel: its ``next`` is the head, its ``prev`` the tail.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._sentinel = capacity
        self._next = [self._sentinel] * (capacity + 1)
        self._prev = [self._sentinel] * (capacity + 1)
        self._queued = [False] * capacity
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, page_id: int) -> bool:
        return 0 <= page_id < self._capacity and self._queued[page_id]

    def __iter__(self) -> Iterator[int]:
        """Page ids from head (next to be evicted) to tail (most recently freed)."""
        node = self._next[self._sentinel]
        while node != self._sentinel:
            yield node
            node = self._next[node]

    def _check_insertable(self, page_id: int) -> None:
        if not 0 <= page_id < self._capacity:
            raise ValueError(f"page id {page_id} out of range [0, {self._capacity})")
        if self._queued[page_id]:
            raise RuntimeError(f"page {page_id} is already in the free queue")

    def _link_after(self, anchor: int, page_id: int) -> None:
        nxt = self._next[anchor]
        self._prev[page_id] = anchor
        self._next[page_id] = nxt
        self._next[anchor] = page_id
        self._prev[nxt] = page_id
        self._queued[page_id] = True
        self._len += 1

    def append(self, page_id: int) -> None:
        """Push at the tail: evicted last."""
        self._check_insertable(page_id)
        self._link_after(self._prev[self._sentinel], page_id)

    def appendleft(self, page_id: int) -> None:
        """Push at the head: handed out first."""
        self._check_insertable(page_id)
        self._link_after(self._sentinel, page_id)

    def remove(self, page_id: int) -> None:
        """Unlink ``page_id`` wherever it is. Raises RuntimeError when it is not queued."""
        if page_id not in self:
            raise RuntimeError(f"page {page_id} is not in the free queue")
        prv, nxt = self._prev[page_id], self._next[page_id]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._prev[page_id] = self._next[page_id] = self._sentinel
        self._queued[page_id] = False
        self._len -= 1

    def popleft(self) -> int:
        """Remove and return the head. Raises RuntimeError when empty."""
        if self._len == 0:
            raise RuntimeError("free queue is empty")
        page_id = self._next[self._sentinel]
        self.remove(page_id)
        return page_id

    def peek(self) -> int | None:
        """The head without removing it, or None when empty."""
        return None if self._len == 0 else self._next[self._sentinel]

    def check_integrity(self) -> None:
        """Walk the list both ways; raise RuntimeError on any broken link or count."""
        forward = list(self)
        if len(forward) != self._len:
            raise RuntimeError(f"free queue: walked {len(forward)} pages, length says {self._len}")
        backward: list[int] = []
        node = self._prev[self._sentinel]
        while node != self._sentinel and len(backward) <= self._len:
            backward.append(node)
            node = self._prev[node]
        if backward[::-1] != forward:
            raise RuntimeError("free queue: forward and backward walks disagree")
        flagged = {p for p in range(self._capacity) if self._queued[p]}
        if flagged != set(forward) or len(set(forward)) != len(forward):
            raise RuntimeError("free queue: membership flags disagree with the linked pages")
