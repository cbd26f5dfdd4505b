"""Staging for the UCX path: D's chunk plan (whole pages, cut where a buffer ends), the cut both
sides make of it, gather and scatter moving exactly a chunk's pages, and buffers made once and
bounded."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.transfer.conftest import MODEL, specs
from transfer.mapper import Segment, map_pages
from transfer.page_table import PageTable
from transfer.paths.staging import (
    RUN_PAGE_BYTES,
    Chunk,
    StagingBuffers,
    chunk_bytes_for,
    cut_chunks,
    gather,
    in_place,
    plan,
    plan_chunks,
    plan_runs,
    scatter,
)
from transfer.pools import pool_rows

TABLE = PageTable.from_specs(MODEL, specs(two_groups=True))
FULL, EXTRA = TABLE.pool("full").page_bytes, TABLE.pool("extra").page_bytes


def test_chunks_hold_whole_pages_in_order_and_never_exceed_the_buffer() -> None:
    segs = map_pages(
        TABLE,
        TABLE,
        {"full": list(range(1, 8)), "extra": [1, 2, 3]},
        {"full": list(range(11, 18)), "extra": [4, 5, 6]},
    )
    size = chunk_bytes_for(TABLE, 8)  # 2 pages of each group
    assert size == 2 * FULL + 2 * EXTRA
    plan = plan_chunks(segs, size)  # a small pull: cut only where a buffer ends
    assert plan == [2 * FULL, 2 * FULL, 2 * FULL, FULL + 3 * EXTRA]  # (a third page: too big)
    chunks = cut_chunks(segs, plan)
    assert [c.nbytes for c in chunks] == plan and [c.index for c in chunks] == list(
        range(len(chunks))
    )
    flat = [(s.src_pool, i) for c in chunks for s in c.segments for i in s.src_ids.tolist()]
    assert flat == [("full", i) for i in range(1, 8)] + [("extra", i) for i in (1, 2, 3)]
    assert sum(c.nbytes for c in chunks) == 7 * FULL + 3 * EXTRA
    with pytest.raises(ValueError, match="larger than a staging buffer"):
        plan_chunks(segs, FULL - 1)
    with pytest.raises(ValueError, match="at least one page"):
        chunk_bytes_for(TABLE, 3)


def test_large_host_pages_go_in_runs_consecutive_on_both_sides() -> None:
    page = RUN_PAGE_BYTES
    src = np.array([4, 5, 6, 7, 9, 10, 11, 20])
    dst = np.array([1, 2, 8, 9, 10, 11, 12, 13])  # breaks after 2 (dst) and 7 (src), 11 (src)
    seg = Segment("full", "full", src, dst, page)
    assert plan_runs([seg], 1 << 30) == [2 * page, 2 * page, 3 * page, page]
    assert plan_runs([seg], 2 * page) == [2 * page, 2 * page, 2 * page, page, page]  # buffer cap
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert plan([seg], 1 << 30, cpu) == plan_runs([seg], 1 << 30)
    assert plan([seg], 1 << 30, cuda) == plan_chunks([seg], 1 << 30)  # device pools: staged
    small = Segment("full", "full", src, dst, page // 2)
    assert plan([small], 1 << 30, cpu) == plan_chunks([small], 1 << 30)  # small pages: staged


def test_in_place_is_a_view_of_one_stretch_of_a_host_pool_else_none() -> None:
    rows = {"full": torch.arange(16 * 8, dtype=torch.uint8).view(16, 8)}

    def chunk(src: list[int], dst: list[int], nbytes: int = 8, offset: int = 0) -> Chunk:
        seg = Segment("full", "full", np.array(src), np.array(dst), nbytes, offset, offset)
        return Chunk(0, (seg,))

    view = in_place(chunk([3, 4, 5], [9, 2, 7]), rows, source=True)
    assert view is not None and view.data_ptr() == rows["full"][3].data_ptr()  # the pool itself
    assert torch.equal(view, rows["full"][3:6].flatten())
    assert in_place(chunk([3, 4, 5], [9, 2, 7]), rows, source=False) is None  # D's: scattered
    assert in_place(chunk([3, 5], [1, 2]), rows, source=True) is None  # a gap
    assert in_place(chunk([3, 4], [1, 2], nbytes=4, offset=4), rows, source=True) is None  # part
    two = Chunk(0, chunk([1], [1]).segments + chunk([2], [2]).segments)
    assert in_place(two, rows, source=True) is None  # two segments


def test_a_pull_that_fits_a_buffer_goes_in_one_chunk() -> None:
    page = 64 << 10
    seg = Segment("full", "full", np.arange(1, 257), np.arange(1, 257), page)  # 16 MiB
    assert plan_chunks([seg], 1 << 30) == [16 << 20]
    assert plan_chunks([seg], (5 << 20) + 1) == [5 << 20, 5 << 20, 5 << 20, 1 << 20]


def test_a_plan_that_does_not_cut_the_pages_is_refused() -> None:
    seg = Segment("full", "full", np.arange(1, 5), np.arange(1, 5), 100)
    assert [c.nbytes for c in cut_chunks([seg], [100, 300])] == [100, 300]
    for bad in ([150, 250], [100, 200], [100, 200, 100, 100], [0, 400], []):
        with pytest.raises(ValueError, match="page boundaries|do not cut"):
            cut_chunks([seg], bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_gather_then_scatter_moves_exactly_the_chunk_pages(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    group = specs(dtype=dtype, two_groups=True)
    src_bufs = {
        s.name: torch.randint(0, 255, s.buffer_shape, generator=gen).to(dtype) for s in group
    }
    dst_bufs = {s.name: torch.zeros(s.buffer_shape, dtype=dtype) for s in group}
    page_bytes = {s.name: s.page_bytes for s in group}
    src_rows, dst_rows = pool_rows(src_bufs, page_bytes), pool_rows(dst_bufs, page_bytes)
    table = PageTable.from_specs(MODEL, group)
    segs = map_pages(
        table, table, {"full": [9, 3, 7], "extra": [5]}, {"full": [2, 8, 4], "extra": [6]}
    )
    (chunk,) = cut_chunks(segs, plan_chunks(segs, 1 << 20))
    staged = torch.empty(chunk.nbytes + 3, dtype=torch.uint8)
    gather(chunk, src_rows, staged)
    scatter(chunk, staged, dst_rows)
    for name, pairs in (("full", [(9, 2), (3, 8), (7, 4)]), ("extra", [(5, 6)])):
        for s, d in pairs:
            assert torch.equal(dst_rows[name][d], src_rows[name][s])
        untouched = [i for i in range(dst_rows[name].shape[0]) if i not in {d for _, d in pairs}]
        assert not dst_rows[name][untouched].any()


def test_a_page_slice_segment_moves_only_its_bytes() -> None:
    """The offsets a head-range mapping would use: only that slice of each page moves."""
    rows = {"full": torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)}
    out = {"full": torch.zeros(4, 16, dtype=torch.uint8)}
    seg = Segment("full", "full", np.array([1, 2]), np.array([3, 1]), 8, src_offset=8, dst_offset=0)
    (chunk,) = cut_chunks([seg], [16])
    staged = torch.empty(16, dtype=torch.uint8)
    gather(chunk, rows, staged)
    scatter(chunk, staged, out)
    assert torch.equal(out["full"][3, :8], rows["full"][1, 8:]) and not out["full"][3, 8:].any()
    assert torch.equal(out["full"][1, :8], rows["full"][2, 8:])


def test_staging_buffers_are_made_once_and_bounded() -> None:
    async def main() -> None:
        bufs = StagingBuffers(torch.device("cpu"), 64, 2)
        a, b = bufs.try_acquire(), bufs.try_acquire()
        assert a is not None and b is not None and bufs.try_acquire() is None
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one block
        waiting = asyncio.ensure_future(bufs.acquire())
        await asyncio.sleep(0)
        assert not waiting.done()
        bufs.release(a)
        assert (await waiting) is a

    asyncio.run(main())


def test_non_contiguous_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="must be contiguous"):
        pool_rows({"full": torch.zeros(4, 8).t()}, {"full": 16})
