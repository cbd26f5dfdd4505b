"""Plans: what one pull moves. TransferPlan cuts a request's fragments into chunks that each fit
one staging buffer (the UCX path); DirectPlan pairs page ids for one copy (a direct read by D,
direct_read.py).

Both sides of a UCX pull build the plan from the same inputs (page tables, page ids, chunk size), so
chunk ``i`` means the same bytes on both. A chunk's bytes on the wire are its fragments'
bytes, back to back, in order. Fragments are split only at page boundaries, so a staging copy
always moves whole pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from kvcache.spec import NULL_PAGE
from transfer.mapper import (
    Fragment,
    MapperError,
    checked_ids,
    map_page_ids,
    map_pages,
    match_pools,
)
from transfer.page_table import PageTable, PoolDescriptor

DIRECT_MAX_BYTES = 1 << 30  # the largest single message: one page run of 1 GiB
_NBYTES = itemgetter(4)  # Fragment.nbytes, read in C (sums over thousands of fragments)


@dataclass(frozen=True)
class Chunk:
    index: int
    fragments: tuple[Fragment, ...]

    @cached_property  # asked for per send, receive and check; a chunk can hold thousands of pages
    def nbytes(self) -> int:
        return sum(map(_NBYTES, self.fragments))

    @property
    def contiguous(self) -> bool:
        """One run on both sides: it can go straight from the source pool to the destination pool
        without a staging copy (and must, when it is larger than a staging buffer)."""
        return len(self.fragments) == 1

    @cached_property
    def src_run(self) -> tuple[str, int] | None:
        """(pool, byte offset) when the chunk's source bytes are one run of one pool in wire order,
        whatever its destination pages are; else None."""
        return _one_run((f.src_pool, f.src_offset, f.nbytes) for f in self.fragments)

    @cached_property
    def dst_run(self) -> tuple[str, int] | None:
        """(pool, byte offset) when the chunk's destination bytes are one run of one pool in wire
        order; else None."""
        return _one_run((f.dst_pool, f.dst_offset, f.nbytes) for f in self.fragments)

    def sends_straight(self, zero_copy: bool, staging_bytes: int) -> bool:
        """Whether P sends the chunk from its pool without a gather (each side decides for
        itself): its side is one run, and ``zero_copy`` is on or the chunk cannot fit a staging
        buffer (only a run on both sides is cut that long)."""
        return self.src_run is not None and (zero_copy or self.nbytes > staging_bytes)

    def receives_straight(self, zero_copy: bool, staging_bytes: int) -> bool:
        """Whether D receives the chunk into its pool without a scatter (the mirror of
        ``sends_straight``)."""
        return self.dst_run is not None and (zero_copy or self.nbytes > staging_bytes)


def _one_run(parts: Iterator[tuple[str, int, int]]) -> tuple[str, int] | None:
    """(pool, start) of (pool, offset, bytes) parts that follow each other in one pool, read only
    up to the first that does not (a chunk can hold thousands of fragments)."""
    first = next(parts, None)
    if first is None:
        return None
    pool, start, end = first[0], first[1], first[1] + first[2]
    for p, offset, nbytes in parts:
        if p != pool or offset != end:
            return None
        end += nbytes
    return pool, start


@dataclass(frozen=True)
class TransferPlan:
    chunks: tuple[Chunk, ...]
    chunk_bytes: int

    @cached_property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


def chunk_fragments(
    fragments: Sequence[Fragment], chunk_bytes: int, page_bytes: Mapping[str, int]
) -> TransferPlan:
    """Cut ``fragments`` (page-aligned, ``page_bytes`` by source pool) into chunks.

    A run of at least ``chunk_bytes`` becomes chunks of its own, up to DIRECT_MAX_BYTES each: they
    need no staging (one run on both sides), and one large message moves faster than many. Shorter
    runs are packed into chunks of at most ``chunk_bytes``, filling each before starting the next.
    """
    if sum(map(_NBYTES, fragments)) <= chunk_bytes:
        # All in one chunk (every fragment, a page at least, then fits): what the loop below would
        # make, without its per-fragment steps (a scattered 256 MiB pull in one piece chunk).
        one = Chunk(0, tuple(fragments))
        return TransferPlan((one,) if fragments else (), chunk_bytes)
    chunks: list[Chunk] = []
    current: list[Fragment] = []
    room = chunk_bytes
    for frag in fragments:
        page = page_bytes[frag.src_pool]
        if page > chunk_bytes:
            raise ValueError(
                f"a page of pool {frag.src_pool!r} ({page} bytes) is larger than a chunk ({chunk_bytes})"
            )
        done = 0
        if frag.nbytes >= chunk_bytes:
            if current:
                chunks.append(Chunk(len(chunks), tuple(current)))
                current, room = [], chunk_bytes
            step = max(page, DIRECT_MAX_BYTES // page * page)
            for start in range(0, frag.nbytes, step):
                take = min(step, frag.nbytes - start)
                chunks.append(
                    Chunk(
                        len(chunks),
                        (
                            Fragment(
                                frag.src_pool,
                                frag.dst_pool,
                                frag.src_offset + start,
                                frag.dst_offset + start,
                                take,
                            ),
                        ),
                    )
                )
            continue
        if frag.nbytes <= room:  # the common case (single pages): no new object per page
            current.append(frag)
            room -= frag.nbytes
            continue
        while done < frag.nbytes:
            take = min(frag.nbytes - done, room // page * page)
            if take == 0:
                chunks.append(Chunk(len(chunks), tuple(current)))
                current, room = [], chunk_bytes
                continue
            current.append(
                Fragment(
                    frag.src_pool,
                    frag.dst_pool,
                    frag.src_offset + done,
                    frag.dst_offset + done,
                    take,
                )
            )
            done += take
            room -= take
    if current:
        chunks.append(Chunk(len(chunks), tuple(current)))
    return TransferPlan(tuple(chunks), chunk_bytes)


def build_plan(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
    chunk_bytes: int,
) -> TransferPlan:
    """Map the pages (mapper.map_pages) and cut the fragments into chunks."""
    fragments = map_pages(src, dst, src_pages, dst_pages)
    return chunk_fragments(fragments, chunk_bytes, {p.name: p.page_bytes for p in src.pools})


def chunk_bytes_for(table: PageTable, staging_tokens: int) -> int:
    """Bytes of one staging buffer: ``staging_tokens`` tokens of every pool, in whole pages."""
    largest_page = max(p.tokens_per_page for p in table.pools)
    if staging_tokens < largest_page:
        raise ValueError(
            f"staging_tokens ({staging_tokens}) must hold at least one page ({largest_page} tokens)"
        )
    return sum(staging_tokens // p.tokens_per_page * p.page_bytes for p in table.pools)


@dataclass(frozen=True)
class DirectPlan:
    """What a direct read copies (direct_copy.py, host_copy.py): page id pairs per matched pool
    pair, in one go. Built straight from the id lists: no per-page objects, since a long prompt
    has thousands of pages."""

    pairs: tuple[tuple[str, str, np.ndarray, np.ndarray], ...]  # int64 page ids
    total_bytes: int


def unchecked_direct_pairs(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, np.ndarray],
    dst_pages: Mapping[str, np.ndarray],
    skip: int,
) -> tuple[tuple[str, str, np.ndarray, np.ndarray], ...] | None:
    """The id pairs of a direct read before any id is checked: pools matched, counts equal, page
    ``skip + i`` of source pool ``g`` going to page ``i`` of its destination pool. Only for a copy
    whose kernel skips ids outside the pools (and the null page); the caller runs ``direct_plan``
    while that copy runs and fails the read if it raises. None when the pools or counts do not
    line up (``direct_plan`` then says why)."""
    try:
        matched = match_pools(src, dst)
    except MapperError:
        return None
    if len(src_pages) != len(matched) or len(dst_pages) != len(matched) or skip < 0:
        return None
    pairs = []
    for sp, dp in matched.items():
        s, d = src_pages.get(sp), dst_pages.get(dp)
        if s is None or d is None or len(s) - skip != len(d):
            return None
        pairs.append((sp, dp, s[skip:], d))
    return tuple(pairs)


def direct_plan(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
) -> DirectPlan:
    """Raises MapperError like build_plan for pools or ids that cannot be mapped."""
    return _direct(map_page_ids(src, dst, src_pages, dst_pages))


class IdPair(NamedTuple):
    """One matched pool pair's ids as a copy read them (the C launcher's slot,
    transfer/direct_copy.py), with the bounds and repeats the launcher found: ``repeats`` is 1 or
    0, or -1 when it could not tell."""

    src: np.ndarray
    dst: np.ndarray
    src_low: int
    src_high: int
    dst_low: int
    dst_high: int
    repeats: int

    def plainly_valid(self, src: PoolDescriptor, dst: PoolDescriptor) -> bool:
        """Whether ``checked_ids`` would pass these ids unchanged: every id in its pool, no null
        page on either side, no destination page twice."""
        return plainly_valid(self[2:], src.num_pages, dst.num_pages)


def plainly_valid(stats: Sequence[int], src_pages: int, dst_pages: int) -> bool:
    """IdPair.plainly_valid from the launcher's (source low, high, destination low, high,
    repeats) and the pools' page counts (no ids: none is non-empty without its bounds)."""
    src_low, src_high, dst_low, dst_high, repeats = stats
    return (
        repeats == 0
        and NULL_PAGE < src_low
        and src_high < src_pages
        and NULL_PAGE < dst_low
        and dst_high < dst_pages
    )


def checked_direct_plan(
    src: PageTable, dst: PageTable, pairs: Mapping[tuple[str, str], IdPair]
) -> DirectPlan:
    """``direct_plan`` of ids already paired by matched pools (as a copy read them), for every
    matched pair. Ids the launcher found plainly valid skip the array checks; any others go
    through them, which say what is wrong. Raises MapperError as ``direct_plan`` does."""
    matched = match_pools(src, dst)
    if len(pairs) != len(matched) or any(matched.get(sp) != dp for sp, dp in pairs):
        raise MapperError(f"pool pairs {sorted(pairs)} are not the matched ones {dict(matched)}")
    mapped = []
    for (a, b), ids in pairs.items():
        sp, dp = src.pool(a), dst.pool(b)
        if ids.plainly_valid(sp, dp):
            mapped.append((sp, dp, ids.src, ids.dst))
        else:
            mapped.append((sp, dp, *checked_ids(sp, dp, ids.src, ids.dst)))
    return _direct(mapped)


def _direct(
    mapped: list[tuple[PoolDescriptor, PoolDescriptor, np.ndarray, np.ndarray]],
) -> DirectPlan:
    pairs = tuple((sp.name, dp.name, s, d) for sp, dp, s, d in mapped if s.size)
    return DirectPlan(pairs, sum(len(s) * sp.page_bytes for sp, _, s, _ in mapped))
