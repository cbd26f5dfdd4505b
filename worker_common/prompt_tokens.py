"""PromptTokens: a prompt's token ids packed as int32 bytes, for crossing actor boundaries.

A 32k-token prompt as a Python list pickles as 32k separate integers, and a list is pickled again
at every hop (server -> prefill worker -> decode worker). Packed, it is one ``bytes`` object of 4
bytes per token: pickling copies a buffer instead of walking a list. The list is built lazily, on
the first use that needs it (``tolist()``, indexing, iteration), and kept; pickling sends the packed
bytes again, never the list (scripts/bench_prompt_packing.py measures the difference).

Ids must fit in int32; the HTTP edge checks them against the vocabulary first (cluster/server.py),
so the error a client sees names its field. Building a PromptTokens from out-of-range ids raises
ValueError (a bug, not a client error, by then).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import overload

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# array("i") is the C int: 4 bytes on every platform we run on; checked once here.
if array("i").itemsize != 4:  # pragma: no cover
    raise ImportError("PromptTokens needs a 4-byte C int for array('i')")


class PromptTokens:
    """Immutable token ids: packed int32 bytes, with the list materialized on first use."""

    __slots__ = ("_packed", "_ids")

    def __init__(self, token_ids: Iterable[int]) -> None:
        ids = list(token_ids)
        try:
            packed = array("i", ids)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"token ids must be integers in int32 range: {e}") from None
        self._packed = packed.tobytes()
        self._ids: list[int] | None = ids

    @classmethod
    def from_packed(cls, packed: bytes) -> PromptTokens:
        """The ids of ``packed`` (native-endian int32), not materialized until first use."""
        if len(packed) % 4:
            raise ValueError(f"packed int32 ids need a multiple of 4 bytes, got {len(packed)}")
        obj = cls.__new__(cls)
        obj._packed = bytes(packed)
        obj._ids = None
        return obj

    @property
    def packed(self) -> bytes:
        return self._packed

    def tolist(self) -> list[int]:
        """The ids as a list (built once, then shared: do not modify it)."""
        if self._ids is None:
            self._ids = array("i", self._packed).tolist()
        return self._ids

    @property
    def materialized(self) -> bool:
        """Whether the list has been built (for tests of the lazy path)."""
        return self._ids is not None

    def __len__(self) -> int:
        return len(self._packed) // 4

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice) and self._ids is None:
            # A prefix (the router's prefix_aware key) without building the whole list.
            start, stop, step = index.indices(len(self))
            if step == 1:
                return array("i", self._packed[start * 4 : max(start, stop) * 4]).tolist()
        return self.tolist()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptTokens):
            return self._packed == other._packed
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._packed)

    def __repr__(self) -> str:
        n = len(self)
        head = self[:8]
        return f"PromptTokens({head}{'...' if n > 8 else ''}, len={n})"

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        # Packed through pickling, whether or not the list was built on this side.
        return (PromptTokens.from_packed, (self._packed,))
