"""Mapper: (source page table, destination page table, page ids) -> page segments.

A Segment says "copy bytes ``[src_offset, src_offset + nbytes_per_page)`` of page ``src_ids[i]`` of
the source pool to ``[dst_offset, ...)`` of page ``dst_ids[i]`` of the destination pool", for one
matched pool pair (pools match by ``pool_role`` and sliding window). Every data path moves
segments: the UCX path gathers them into a staging buffer, the direct paths copy them page to page.

Here only pools of equal geometry are served (the identity mapping: whole pages, offsets 0).
Head-sharded pools of tensor-parallel ranks holding other head ranges are mapped by
transfer/tp_mapper.py (each page to the slice of the heads both hold, with the offsets above);
given to ``map_pages`` they are refused with a MapperError that says so, never copied wrongly.
Pool groups may list different numbers of pages (a sliding-window group holds only its window's):
each pair is mapped on its own.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from kvcache.spec import NULL_PAGE
from transfer.page_table import PageTable, PoolDescriptor


class MapperError(ValueError):
    """The two page tables (or the page ids) cannot be mapped onto each other."""


@dataclass(frozen=True, eq=False)
class Segment:
    src_pool: str
    dst_pool: str
    src_ids: np.ndarray  # int64 [n]
    dst_ids: np.ndarray  # int64 [n]
    nbytes_per_page: int
    src_offset: int = 0
    dst_offset: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.src_ids) * self.nbytes_per_page

    def part(self, start: int, stop: int) -> Segment:
        """Pages ``[start, stop)`` of this segment."""
        return Segment(
            self.src_pool,
            self.dst_pool,
            self.src_ids[start:stop],
            self.dst_ids[start:stop],
            self.nbytes_per_page,
            self.src_offset,
            self.dst_offset,
        )


@functools.lru_cache(maxsize=64)  # asked on every pull, for the few page tables a worker meets
def match_pools(src: PageTable, dst: PageTable, resplit: bool = False) -> Mapping[str, str]:
    """Source pool name -> destination pool name, matched by equal ``pool_role`` and sliding
    window (a hybrid model's full-attention and window groups both hold keys and values). With
    ``resplit``, head-major pools of other head ranges match too (transfer/tp_mapper.py moves
    the heads both hold); without, only pools of equal geometry."""
    by_kind: dict[tuple[tuple[str, ...], int], PoolDescriptor] = {}
    for pool in dst.pools:
        if _kind(pool) in by_kind:
            raise MapperError(f"destination has two pools with {_describe(pool)}")
        by_kind[_kind(pool)] = pool
    matched: dict[str, str] = {}
    for pool in src.pools:
        peer = by_kind.pop(_kind(pool), None)
        if peer is None:
            raise MapperError(
                f"source pool {pool.name!r} ({_describe(pool)}) has no destination pool with the "
                "same roles and window (or shares them with another source pool)"
            )
        if not resplit:
            _check_servable(pool, peer)
        matched[pool.name] = peer.name
    if by_kind:  # their pages would never be filled
        raise MapperError(
            f"destination pools {[p.name for p in by_kind.values()]} have no source pool"
        )
    return MappingProxyType(matched)


def _kind(pool: PoolDescriptor) -> tuple[tuple[str, ...], int]:
    return pool.pool_role, pool.window


def _describe(pool: PoolDescriptor) -> str:
    window = f"a window of {pool.window}" if pool.window else "full attention"
    return f"roles {list(pool.pool_role)}, {window}"


def _check_servable(src: PoolDescriptor, dst: PoolDescriptor) -> None:
    if src.mapper_kind != dst.mapper_kind:
        raise MapperError(
            f"pool {src.name!r}: mapper kinds differ (source {src.mapper_kind}, destination {dst.mapper_kind})"
        )
    if src.geometry() == dst.geometry():
        return
    if (src.head_start, src.num_kv_heads) != (dst.head_start, dst.num_kv_heads):
        raise MapperError(
            f"pool {src.name!r} ({src.mapper_kind}): head ranges differ (source "
            f"{src.head_start}+{src.num_kv_heads}, destination {dst.head_start}+{dst.num_kv_heads}); "
            "re-splitting head-sharded pools is transfer/tp_mapper.py's work"
        )
    raise MapperError(
        f"pool {src.name!r}: page geometry differs (source {src.geometry()}, destination "
        f"{dst.geometry()}); only identical pools can be mapped today"
    )


def map_pages(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
) -> list[Segment]:
    """One segment per matched pool pair with pages, in the source's pool order: page
    ``src_pages[g][i]`` goes to ``dst_pages[match(g)][i]``. A source entry equal to the null page (a
    page a sliding window already dropped) moves nothing. Raises MapperError for unmatched pools,
    page lists of different lengths, ids outside a pool, the null page as a destination, or a
    destination page listed twice."""
    matched = match_pools(src, dst)
    if set(src_pages) != set(matched) or set(dst_pages) != set(matched.values()):
        raise MapperError(
            f"page ids name pools {sorted(src_pages)} -> {sorted(dst_pages)}, expected "
            f"{sorted(matched)} -> {sorted(matched.values())}"
        )
    segments = []
    for pool in src.pools:
        peer = dst.pool(matched[pool.name])
        s = _ids(src_pages[pool.name], pool, "source")
        d = _ids(dst_pages[peer.name], peer, "destination")
        if len(s) != len(d):
            raise MapperError(
                f"pool {pool.name!r}: {len(s)} source pages but {len(d)} destination pages"
            )
        if NULL_PAGE in s:
            kept = [k for k, i in enumerate(s) if i != NULL_PAGE]
            s, d = [s[k] for k in kept], [d[k] for k in kept]
        if NULL_PAGE in d:
            raise MapperError(f"destination pool {peer.name!r}: the null page cannot receive data")
        if len(set(d)) != len(d):
            raise MapperError(f"destination pool {peer.name!r}: a page id is listed twice")
        if s:
            segments.append(
                Segment(
                    pool.name,
                    peer.name,
                    np.array(s, np.int64),
                    np.array(d, np.int64),
                    pool.page_bytes,
                )
            )
    return segments


def _ids(ids: Sequence[int], pool: PoolDescriptor, side: str) -> list[int]:
    # Plain Python, not numpy: a pull maps a few to a few thousand ids, where numpy's calls cost
    # more than the work (a quarter of a millisecond per pull with cold caches).
    try:
        arr = [operator.index(i) for i in ids]
    except TypeError as e:
        raise MapperError(f"{side} pool {pool.name!r}: page ids are not integers ({e})") from None
    if arr and (min(arr) < 0 or max(arr) >= pool.num_pages):
        bad = [i for i in arr if not 0 <= i < pool.num_pages][:8]
        raise MapperError(
            f"{side} pool {pool.name!r}: page ids {bad} outside [0, {pool.num_pages})"
        )
    return arr


def total_bytes(segments: Sequence[Segment]) -> int:
    return sum(s.nbytes for s in segments)


def source_bytes(src: PageTable, src_pages: Mapping[str, Sequence[int]]) -> int:
    """The bytes ``map_pages`` moves for these source pages (whole pages; the null page moves
    nothing), counted without mapping them: what a direct read declares and P checks."""
    return sum(
        (len(ids) - list(ids).count(NULL_PAGE)) * src.pool(name).page_bytes
        for name, ids in src_pages.items()
    )
