"""Heterogeneous tensor parallelism: which prefill rank's bytes each decode rank reads.

A prefill worker of ``a`` ranks and a decode worker of ``b`` ranks hold the same pages (rank 0's
scheduler hands out page ids for all its ranks), each rank its head shard of every page
(kvcache/head_shard.py). In the head-major page layout (kvcache/spec.py) a run of consecutive heads
of a page is one contiguous run of ``head_bytes`` per head, so a decode rank's pull from one
prefill rank is one fragment per page: the heads both hold, from ``(h - src.head_start) *
head_bytes`` of the source page to ``(h - dst.head_start) * head_bytes`` of the destination page.

``map_tp_pages`` plans a decode rank's pulls on page tables alone: every head it holds is read
from exactly one prefill rank, the lowest-numbered one that holds it (with replicated heads, the
head's primary rank: kvcache/head_shard.py), and a head no prefill rank holds is a MapperError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvcache.spec import NULL_PAGE
from transfer.mapper import MapperError, Segment, _ids, match_pools
from transfer.page_table import PageTable, PoolDescriptor

HEAD_MAJOR = frozenset({"HND", "REPLICATED"})


def head_bytes(pool: PoolDescriptor) -> int:
    return pool.page_bytes // pool.num_kv_heads


def _check_head_split(src: PoolDescriptor, dst: PoolDescriptor) -> None:
    """Two pools whose heads may be re-split: head-major, one page geometry per head."""
    if src.mapper_kind not in HEAD_MAJOR or dst.mapper_kind not in HEAD_MAJOR:
        raise MapperError(
            f"pool {src.name!r}: head slices move only between head-major pools (HND or "
            f"REPLICATED), got {src.mapper_kind} -> {dst.mapper_kind}"
        )
    same = (src.layout, src.layer_ids, src.tokens_per_page, src.head_dim, src.dtype)
    if same != (dst.layout, dst.layer_ids, dst.tokens_per_page, dst.head_dim, dst.dtype):
        raise MapperError(f"pool {src.name!r}: page geometry per head differs")
    if src.page_bytes % src.num_kv_heads or head_bytes(src) != head_bytes(dst):
        raise MapperError(f"pool {src.name!r}: bytes per head differ")


def head_sources(
    srcs: Sequence[PageTable], dst: PageTable, dst_pool: str
) -> list[tuple[int, int, int]]:
    """(prefill rank, first head, count) runs covering the heads of ``dst``'s pool ``dst_pool``:
    each head from the lowest-numbered rank of ``srcs`` that holds it."""
    target = dst.pool(dst_pool)
    runs: list[tuple[int, int, int]] = []
    for head in range(target.head_start, target.head_start + target.num_kv_heads):
        rank = next(
            (r for r, table in enumerate(srcs) if _holds(_peer(table, dst, dst_pool), head)),
            None,
        )
        if rank is None:
            raise MapperError(f"pool {dst_pool!r}: no prefill rank holds KV head {head}")
        if runs and runs[-1][0] == rank and runs[-1][1] + runs[-1][2] == head:
            runs[-1] = (rank, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((rank, head, 1))
    return runs


def _peer(src: PageTable, dst: PageTable, dst_pool: str) -> PoolDescriptor:
    reverse = {d: s for s, d in match_pools(src, dst, resplit=True).items()}
    return src.pool(reverse[dst_pool])


def _holds(pool: PoolDescriptor, head: int) -> bool:
    return pool.head_start <= head < pool.head_start + pool.num_kv_heads


def map_tp_pages(
    srcs: Sequence[PageTable],
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
) -> dict[int, list[Segment]]:
    """Prefill rank -> the segments decode rank ``dst`` reads from it (ranks it reads nothing
    from are left out). ``srcs[r]`` is prefill rank r's page table; ``src_pages`` (by source pool
    name) and ``dst_pages`` (by destination pool name) as in mapper.map_pages, the same page ids
    on every rank of a worker. A source page equal to the null page moves nothing."""
    if not srcs:
        raise MapperError("no prefill rank to read from")
    matched = match_pools(srcs[0], dst, resplit=True)
    if set(src_pages) != set(matched) or set(dst_pages) != set(matched.values()):
        raise MapperError(
            f"page ids name pools {sorted(src_pages)} -> {sorted(dst_pages)}, expected "
            f"{sorted(matched)} -> {sorted(matched.values())}"
        )
    out: dict[int, list[Segment]] = {}
    for dst_name in matched.values():
        for rank, first, count in head_sources(srcs, dst, dst_name):
            src_name = _peer(srcs[rank], dst, dst_name).name
            out.setdefault(rank, []).extend(
                map_heads(
                    srcs[rank],
                    dst,
                    {src_name: src_pages[src_name]},
                    {dst_name: dst_pages[dst_name]},
                    first,
                    count,
                )
            )
    return out


def map_heads(
    src: PageTable,
    dst: PageTable,
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
    first: int,
    count: int,
) -> list[Segment]:
    """The segments that copy KV heads ``[first, first + count)`` of the pages named, from ``src``
    (which must hold them) to ``dst`` (which must hold them too): one head-slice fragment per page
    for each pool named in ``src_pages`` (by source name) and ``dst_pages`` (by destination
    name). A source page equal to the null page moves nothing."""
    matched = match_pools(src, dst, resplit=True)
    segments = []
    for src_name, src_ids in src_pages.items():
        if src_name not in matched or matched[src_name] not in dst_pages:
            raise MapperError(f"pool {src_name!r} has no destination page ids")
        source, target = src.pool(src_name), dst.pool(matched[src_name])
        _check_head_split(source, target)
        for pool, side in ((source, "source"), (target, "destination")):
            if not (_holds(pool, first) and _holds(pool, first + count - 1)) or count < 1:
                raise MapperError(
                    f"{side} pool {pool.name!r} holds KV heads [{pool.head_start}, "
                    f"{pool.head_start + pool.num_kv_heads}), not all of [{first}, {first + count})"
                )
        s = _ids(src_ids, source, "source")
        d = _ids(dst_pages[target.name], target, "destination")
        if len(s) != len(d):
            raise MapperError(
                f"pool {src_name!r}: {len(s)} source pages but {len(d)} destination pages"
            )
        if NULL_PAGE in s:
            kept = [k for k, i in enumerate(s) if i != NULL_PAGE]
            s, d = [s[k] for k in kept], [d[k] for k in kept]
        if NULL_PAGE in d:
            raise MapperError(
                f"destination pool {target.name!r}: the null page cannot receive data"
            )
        if len(set(d)) != len(d):
            raise MapperError(f"destination pool {target.name!r}: a page id is listed twice")
        if not s:
            continue
        per_head = head_bytes(source)
        segments.append(
            Segment(
                source.name,
                target.name,
                np.array(s, np.int64),
                np.array(d, np.int64),
                count * per_head,
                (first - source.head_start) * per_head,
                (first - target.head_start) * per_head,
            )
        )
    return segments


def head_source_bytes(src: PageTable, src_pages: Mapping[str, Sequence[int]], count: int) -> int:
    """The bytes ``map_heads`` moves for ``count`` KV heads of these source pages (the null page
    moves nothing), counted without mapping them: what a direct read of a head-slice lease
    declares and P checks (mapper.source_bytes for whole pages)."""
    return sum(
        (len(ids) - list(ids).count(NULL_PAGE)) * count * head_bytes(src.pool(name))
        for name, ids in src_pages.items()
    )
