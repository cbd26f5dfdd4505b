"""Mapper: (source page table, destination page table, page ids) -> byte fragments.

A fragment says "copy ``nbytes`` from ``src_offset`` of the source pool to ``dst_offset`` of the
destination pool"; offsets are bytes into a pool's storage (page ``p`` starts at ``p * page_bytes``,
kvcache/spec.py). Pools are matched by ``pool_role``. Only pools of equal geometry are served today
(the identity mapping: whole pages, runs of consecutive pages on both sides merged into one fragment).
Anything else, such as head-sharded (HND) pools with different head counts, is refused with a
MapperError that says so, never copied wrongly.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from kvcache.spec import NULL_PAGE
from transfer.page_table import PageTable, PoolDescriptor


class MapperError(ValueError):
    """The two page tables (or the page ids) cannot be mapped onto each other."""


class Fragment(NamedTuple):
    # A named tuple, not a frozen dataclass: a long prompt's scattered pages make thousands of
    # these per pull on each side, and a tuple is built several times faster.
    src_pool: str
    dst_pool: str
    src_offset: int
    dst_offset: int
    nbytes: int


@functools.lru_cache(maxsize=64)  # asked on every pull, for the few page tables a worker meets
def match_pools(src: PageTable, dst: PageTable) -> Mapping[str, str]:
    """Source pool name -> destination pool name, matched by equal ``pool_role`` (one read-only
    mapping shared by every caller)."""
    by_role: dict[tuple[str, ...], PoolDescriptor] = {}
    for pool in dst.pools:
        if pool.pool_role in by_role:
            raise MapperError(f"destination has two pools with roles {list(pool.pool_role)}")
        by_role[pool.pool_role] = pool
    matched: dict[tuple[str, ...], str] = {}  # source roles -> destination pool
    for pool in src.pools:
        if pool.pool_role in matched:  # (two sources would fill one destination pool)
            raise MapperError(f"source has two pools with roles {list(pool.pool_role)}")
        peer = by_role.get(pool.pool_role)
        if peer is None:
            raise MapperError(
                f"source pool {pool.name!r} (roles {list(pool.pool_role)}) has no destination pool with "
                f"the same roles (destination roles: {[list(r) for r in by_role]})"
            )
        _check_servable(pool, peer)
        matched[pool.pool_role] = peer.name
    unmatched = [p.name for role, p in by_role.items() if role not in matched]
    if unmatched:  # their pages would never be filled
        raise MapperError(f"destination pools {unmatched} have no source pool with the same roles")
    return MappingProxyType({p.name: matched[p.pool_role] for p in src.pools})


def _check_servable(src: PoolDescriptor, dst: PoolDescriptor) -> None:
    if src.mapper_kind != dst.mapper_kind:
        raise MapperError(
            f"pool {src.name!r}: mapper kinds differ (source {src.mapper_kind}, destination {dst.mapper_kind})"
        )
    if src.geometry() == dst.geometry():
        return
    if src.num_kv_heads != dst.num_kv_heads:
        raise MapperError(
            f"pool {src.name!r} ({src.mapper_kind}): head counts differ (source {src.num_kv_heads}, "
            f"destination {dst.num_kv_heads}); re-splitting head-sharded pools is not supported yet"
        )
    raise MapperError(
        f"pool {src.name!r} ({src.mapper_kind}): page geometry differs (source {src.geometry()}, "
        f"destination {dst.geometry()}); only identical pools can be mapped today"
    )


def map_page_ids(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
) -> list[tuple[PoolDescriptor, PoolDescriptor, np.ndarray, np.ndarray]]:
    """(source pool, destination pool, source ids, destination ids) for every source pool, in pool
    order, page ``src_pages[g][i]`` going to ``dst_pages[match(g)][i]``; ids as int64 arrays (a
    long prompt has thousands of pages: every check runs in numpy). A source entry equal to the
    null page (a page a sliding window already dropped) moves nothing and is left out. Raises
    MapperError for unmatched pools, page lists of different lengths, page ids out of range, or a
    destination page listed twice."""
    matched = match_pools(src, dst)
    if set(src_pages) != set(matched):
        raise MapperError(
            f"source page ids name pools {sorted(src_pages)}, the page table has {sorted(matched)}"
        )
    if set(dst_pages) != set(matched.values()):
        raise MapperError(
            f"destination page ids name pools {sorted(dst_pages)}, expected {sorted(matched.values())}"
        )
    out = []
    for pool in src.pools:
        peer = dst.pool(matched[pool.name])
        s_ids = np.asarray(src_pages[pool.name], dtype=np.int64).reshape(-1)
        d_ids = np.asarray(dst_pages[peer.name], dtype=np.int64).reshape(-1)
        out.append((pool, peer, *checked_ids(pool, peer, s_ids, d_ids)))
    return out


def checked_ids(
    pool: PoolDescriptor, peer: PoolDescriptor, s_ids: np.ndarray, d_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The ids of one matched pool pair (int64 arrays), checked as ``map_page_ids`` says, without
    the source's null pages (and their destination pages)."""
    if len(s_ids) != len(d_ids):
        raise MapperError(
            f"pool {pool.name!r}: {len(s_ids)} source pages but {len(d_ids)} destination pages"
        )
    if s_ids.size and _check_ids(s_ids, pool, "source") <= NULL_PAGE:  # null pages listed
        kept = s_ids != NULL_PAGE
        s_ids, d_ids = s_ids[kept], d_ids[kept]
    _check_ids(d_ids, peer, "destination", distinct=True)
    return s_ids, d_ids


def map_pages(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
) -> list[Fragment]:
    """Fragments copying the pages of ``map_page_ids``, in pool order then page order; runs of
    pages consecutive on both sides are merged into one fragment."""
    fragments: list[Fragment] = []
    for pool, peer, s_ids, d_ids in map_page_ids(src, dst, src_pages, dst_pages):
        fragments.extend(_runs(pool, peer, s_ids, d_ids))
    return fragments


def _check_ids(ids: np.ndarray, pool: PoolDescriptor, side: str, distinct: bool = False) -> int:
    """Raises MapperError for bad ids; returns the smallest id (0 for none). On every pull's
    latency path: one min and one max, and the costlier tests only when they can fail."""
    if not ids.size:
        return 0
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= pool.num_pages:
        bad = ids[(ids < 0) | (ids >= pool.num_pages)][:8].tolist()
        raise MapperError(
            f"{side} pool {pool.name!r}: page ids {bad} outside [0, {pool.num_pages})"
        )
    if side == "destination" and low <= NULL_PAGE <= high and (ids == NULL_PAGE).any():
        raise MapperError(f"destination pool {pool.name!r}: the null page cannot receive data")
    if distinct and ids.size > 1 and _has_repeats(ids):
        raise MapperError(f"{side} pool {pool.name!r}: a page id is listed twice")
    return low


def _has_repeats(ids: np.ndarray) -> bool:
    if ids.size <= 512:  # a set of a few hundred ints beats a numpy sort's call overhead
        return len(set(ids.tolist())) != ids.size
    return bool((np.diff(np.sort(ids)) == 0).any())  # a sort beats np.unique


def page_runs(s_ids: np.ndarray, d_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source id, first destination id, length) of each run of id pairs where both ids go
    up by one, as int64 arrays (one numpy pass: a long prompt has thousands of pages)."""
    s_ids = np.asarray(s_ids, dtype=np.int64)
    d_ids = np.asarray(d_ids, dtype=np.int64)
    if s_ids.size == 0:
        return s_ids, d_ids, s_ids
    # (slices, not np.diff, whose Python wrapper costs more than the work at a few pages)
    first = np.empty(s_ids.size, dtype=bool)
    first[0] = True
    np.not_equal(s_ids[1:] - s_ids[:-1], 1, out=first[1:])
    first[1:] |= d_ids[1:] - d_ids[:-1] != 1
    starts = np.flatnonzero(first)
    ends = np.concatenate((starts[1:], [s_ids.size]))
    return s_ids[starts], d_ids[starts], ends - starts


SMALL_RUNS = 32  # at most this many pages: a Python loop beats numpy's per-call cost (~7 us)


def _runs(
    src: PoolDescriptor, dst: PoolDescriptor, s_ids: np.ndarray, d_ids: np.ndarray
) -> list[Fragment]:
    """Identity mapping: one fragment per run of pages consecutive on both sides."""
    pb, sn, dn = src.page_bytes, src.name, dst.name
    if len(s_ids) <= SMALL_RUNS:
        out: list[Fragment] = []
        run_s = run_d = run_n = 0
        for s, d in zip(s_ids.tolist(), d_ids.tolist(), strict=True):
            if run_n and s == run_s + run_n and d == run_d + run_n:
                run_n += 1
                continue
            if run_n:
                out.append(Fragment(sn, dn, run_s * pb, run_d * pb, run_n * pb))
            run_s, run_d, run_n = s, d, 1
        if run_n:
            out.append(Fragment(sn, dn, run_s * pb, run_d * pb, run_n * pb))
        return out
    s0, d0, n = page_runs(s_ids, d_ids)
    count = len(n)
    columns = zip(
        itertools.repeat(sn, count),
        itertools.repeat(dn, count),
        (s0 * pb).tolist(),
        (d0 * pb).tolist(),
        (n * pb).tolist(),
    )
    # tuple.__new__ builds each Fragment in C: half the time of Fragment(...), whose __new__ is
    # Python code (a scattered 256 MiB pull has 1024 of them on each side, before its first byte)
    return list(map(tuple.__new__, itertools.repeat(Fragment, count), columns))
