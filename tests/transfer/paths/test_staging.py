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
    StagingBuffers,
    chunk_bytes_for,
    cut_chunks,
    gather,
    plan_chunks,
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
